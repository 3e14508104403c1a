"""Scoring N continuations of one prefix: safelens against the TransformerLens ways.

Rows: safelens (`prefill` + `score_continuations`) against one TransformerLens forward
per prefix + continuation, and against the ideal (one prefix forward plus one batched
continuation forward on TransformerLens' own cache, expanded to the batch). Scaling
rows: the speed-up over per-continuation forwards against prefix length and against N.

Run: `python -m benchmarks.bench_continuations [--quick]`.
"""

from __future__ import annotations

import argparse

import torch
from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

from benchmarks._common import Row, best_time, rotary_model
from safelens import prefill, score_continuations

TARGET_NAIVE = "≥15× faster than one TransformerLens forward per prefix+continuation"
TARGET_IDEAL = "within 1.15× of the ideal (one prefix forward + one batched continuation forward)"


def _inputs(prefix_length: int, n: int, new: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 1000, (prefix_length,), generator=generator)
    continuations = torch.randint(0, 1000, (n, new), generator=generator)
    return prompt, continuations


def _safelens(model, prompt, continuations) -> torch.Tensor:
    prefix = prefill(model, prompt, keep_residuals=False)
    return score_continuations(model, prefix, continuations).log_probs


def _naive(model, prompt, continuations) -> torch.Tensor:
    start = len(prompt) - 1
    rows = []
    for continuation in continuations:
        logits = model(torch.cat([prompt, continuation])[None])[0, start:-1]
        rows.append(logits.float().log_softmax(-1).gather(-1, continuation[:, None])[:, 0])
    return torch.stack(rows)


def _ideal(model, prompt, continuations) -> torch.Tensor:
    n, new = continuations.shape
    cache = TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device, 1)
    ones = torch.ones(1, len(prompt), dtype=torch.long)
    first = model(prompt[None], attention_mask=ones, past_kv_cache=cache)[:, -1]
    for entry in cache.entries:
        entry.past_keys = entry.past_keys.expand(n, -1, -1, -1)
        entry.past_values = entry.past_values.expand(n, -1, -1, -1)
    cache.previous_attention_mask = cache.previous_attention_mask.expand(n, -1)
    cache.freeze()
    mask = torch.ones(n, new, dtype=torch.long)
    logits = model(continuations, attention_mask=mask, past_kv_cache=cache)
    logits = torch.cat([first.expand(n, -1)[:, None], logits[:, :-1]], dim=1)
    return logits.float().log_softmax(-1).gather(-1, continuations[..., None])[..., 0]


def _agree(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a, b, atol=1e-4, rtol=1e-4))


def _rows_for(model, prefix_length: int, n: int, new: int, repeats: int):
    prompt, continuations = (t.to(model.cfg.device) for t in _inputs(prefix_length, n, new))
    ours = _safelens(model, prompt, continuations)
    naive = _naive(model, prompt, continuations)
    ideal = _ideal(model, prompt, continuations)
    t_ours = best_time(lambda: _safelens(model, prompt, continuations), repeats=repeats)
    t_naive = best_time(lambda: _naive(model, prompt, continuations), repeats=repeats, warmup=0)
    t_ideal = best_time(lambda: _ideal(model, prompt, continuations), repeats=repeats)
    return (t_ours, ours), (t_naive, naive), (t_ideal, ideal)


def run(quick: bool = False) -> list[Row]:
    """The benchmark rows (quick: shorter prefixes, fewer repeats)."""
    torch.manual_seed(0)
    model = rotary_model()
    repeats = 1 if quick else 3
    rows: list[Row] = []
    with torch.no_grad():
        main_length = 128 if quick else 512
        (t_ours, ours), (t_naive, naive), (t_ideal, ideal) = _rows_for(
            model, main_length, 32, 8, repeats
        )
        job = f"32 continuations × 8 tokens after a {main_length}-token prefix"
        rows.append(
            Row(
                f"{job}: vs one TL forward each",
                t_ours,
                t_naive,
                "s",
                _agree(ours, naive),
                TARGET_NAIVE,
            )
        )
        rows.append(
            Row(
                f"{job}: vs ideal (TL cache, batched)",
                t_ours,
                t_ideal,
                "s",
                _agree(ours, ideal),
                TARGET_IDEAL,
                note="ratio = ideal / safelens; ≥ 0.87 meets the target",
            )
        )
        lengths = (128, 256) if quick else (128, 256, 512, 1024, 2048)
        for length in lengths:
            (t_ours, ours), (t_naive, naive), _ = _rows_for(model, length, 32, 8, repeats)
            rows.append(
                Row(
                    f"N=32, prefix {length}: vs one TL forward each",
                    t_ours,
                    t_naive,
                    "s",
                    _agree(ours, naive),
                    group="prefix length",
                    x=length,
                )
            )
        counts = (1, 8) if quick else (1, 8, 32, 128)
        for n in counts:
            (t_ours, ours), (t_naive, naive), _ = _rows_for(
                model, 128 if quick else 512, n, 8, repeats
            )
            rows.append(
                Row(
                    f"prefix {128 if quick else 512}, N={n}: vs one TL forward each",
                    t_ours,
                    t_naive,
                    "s",
                    _agree(ours, naive),
                    group="continuations",
                    x=n,
                )
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run for development")
    args = parser.parse_args()
    print(f"{'job':<70} {'ratio':>8}  agree  target")
    for row in run(quick=args.quick):
        print(f"{row.job:<70} {row.ratio:>7.2f}×  {str(row.agree):<5}  {row.target}")


if __name__ == "__main__":
    main()

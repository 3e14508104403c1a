"""The cache itself: one-token appends and greedy cached generation, safelens vs TL.

Rows:

- 4096 one-token appends into a 4-layer cache (`[1, 1, 8, 32]` per layer):
  safelens' growing buffer against TransformerLens' `TransformerLensKeyValueCache`,
  which copies the whole cache on every append.
- SPEC §3 "greedy generation, 1024-token prompt + 512 new tokens" on the benchmark
  rotary model: the same greedy loop driven once with each cache class (the only
  difference), and TransformerLens' own `model.generate(..., use_past_kv_cache=True)`.
- A scaling curve over prompt lengths (group "prompt length").

Run alone: `python -m benchmarks.bench_cache [--quick]`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from transformer_lens import HookedTransformer
from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

from benchmarks._common import Row, rotary_model, synchronize
from safelens import KeyValueCache

GENERATION_TARGET = "≥0.95× TransformerLens' cached generation at every length, identical tokens"


def _race(fns: dict[str, Callable[[], object]], repeats: int) -> tuple[dict[str, float], dict]:
    """Best time of each function, interleaved in alternating order so load hits all alike."""
    best = dict.fromkeys(fns, float("inf"))
    results: dict[str, object] = {}
    order = list(fns)
    for _ in range(repeats):
        order.reverse()
        for name in order:
            fn = fns[name]
            start = time.perf_counter()
            results[name] = fn()
            synchronize()
            best[name] = min(best[name], time.perf_counter() - start)
    return best, results


def _appends(cache_cls: type, steps: int, new: list[torch.Tensor]) -> object:
    cfg = _AppendConfig()
    cache = cache_cls.init_cache(cfg, "cpu", 1)
    for step in range(steps):
        for layer in range(cfg.n_layers):
            cache[layer].append(new[step], new[step])
    return cache


class _AppendConfig:
    n_layers, n_heads, n_key_value_heads, d_head, dtype, device = (
        4,
        8,
        None,
        32,
        torch.float32,
        "cpu",
    )


def append_row(steps: int) -> Row:
    generator = torch.Generator().manual_seed(0)
    new = [torch.randn(1, 1, 8, 32, generator=generator) for _ in range(steps)]
    times, caches = _race(
        {
            "safelens": lambda: _appends(KeyValueCache, steps, new),
            "reference": lambda: _appends(TransformerLensKeyValueCache, steps, new),
        },
        repeats=3,
    )
    ours, theirs = caches["safelens"], caches["reference"]
    agree = all(
        torch.equal(ours[layer].keys, theirs[layer].past_keys)
        for layer in range(4)  # type: ignore[index]
    )
    return Row(
        job=f"{steps} one-token appends, 4 layers [1, 1, 8, 32]",
        safelens=times["safelens"],
        reference=times["reference"],
        unit="s",
        agree=agree,
        target="amortised O(1) appends; never slower than TransformerLens' cache",
    )


@torch.inference_mode()
def greedy(model: HookedTransformer, prompt: torch.Tensor, new_tokens: int, cache) -> torch.Tensor:
    """Greedy cached generation: the prompt in one pass, then one token per pass."""
    logits = model(prompt, attention_mask=torch.ones_like(prompt), past_kv_cache=cache)
    out = [logits[:, -1].argmax(-1, keepdim=True)]
    ones = torch.ones_like(out[0])
    for _ in range(new_tokens - 1):
        logits = model(out[-1], attention_mask=ones, past_kv_cache=cache)
        out.append(logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat([prompt, *out], dim=1)


def generation_rows(
    model: HookedTransformer, prompt_len: int, new_tokens: int, repeats: int, group: str = ""
) -> list[Row]:
    cfg = model.cfg
    prompt = torch.randint(
        0, cfg.d_vocab, (1, prompt_len), generator=torch.Generator().manual_seed(1)
    ).to(cfg.device)

    def ours() -> torch.Tensor:
        return greedy(model, prompt, new_tokens, KeyValueCache.init_cache(cfg, cfg.device))

    def theirs() -> torch.Tensor:
        return greedy(
            model, prompt, new_tokens, TransformerLensKeyValueCache.init_cache(cfg, cfg.device)
        )

    def tl_generate() -> torch.Tensor:
        return model.generate(
            prompt, max_new_tokens=new_tokens, do_sample=False, stop_at_eos=False,
            use_past_kv_cache=True, verbose=False,
        )  # fmt: skip

    fns: dict[str, Callable[[], object]] = {"safelens": ours, "loop": theirs}
    if not group:
        fns["generate"] = tl_generate
    times, tokens = _race(fns, repeats)
    job = f"greedy generation, {prompt_len}-token prompt + {new_tokens} new tokens"
    rows = [
        Row(
            job=f"{job} (same loop, TL cache)",
            safelens=times["safelens"],
            reference=times["loop"],
            unit="s",
            agree=torch.equal(tokens["safelens"], tokens["loop"]),  # type: ignore[arg-type]
            target=GENERATION_TARGET,
            group=group,
            x=float(prompt_len) if group else None,
        )
    ]
    if "generate" in fns:
        rows.append(
            Row(
                job=f"{job} (vs model.generate)",
                safelens=times["safelens"],
                reference=times["generate"],
                unit="s",
                agree=torch.equal(tokens["safelens"], tokens["generate"]),  # type: ignore[arg-type]
                target=GENERATION_TARGET,
            )
        )
    return rows


def run(quick: bool = False) -> list[Row]:
    """All rows of this benchmark; `quick` uses short lengths."""
    model = rotary_model()
    rows = [append_row(512 if quick else 4096)]
    if quick:
        rows += generation_rows(model, 64, 16, repeats=3)
        lengths, new_tokens = [32, 64, 128], 8
    else:
        rows += generation_rows(model, 1024, 512, repeats=5)
        lengths, new_tokens = [256, 1024, 2048], 128
    for length in lengths:
        rows += generation_rows(
            model, length, new_tokens, repeats=3 if quick else 9, group="prompt length"
        )
    return rows


def _print(rows: list[Row]) -> None:
    print(f"{'job':<78} {'ratio':>7}  agree  target")
    for row in rows:
        print(f"{row.job:<78} {row.ratio:>6.2f}x  {str(row.agree):<5}  {row.target}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short lengths, for development")
    _print(run(quick=parser.parse_args().quick))

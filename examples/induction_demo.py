"""Find an induction circuit with safelens, end to end, in about a minute on a CPU.

1. Train a 2-layer attention-only HookedTransformer to continue repeated random token
   sequences (a task solved by induction heads), until it gets them right.
2. (a) Locate the mechanism with key- and value-by-position patching sweeps (heatmaps).
   (b) Frozen-prefix ablation: zero one head's cached keys/values at a time (read-time)
       and see which head the continuation relies on.
   (c) Counterfactual continuations: score several continuations of one shared, frozen
       prefix at once, and generate from it.

Run: python examples/induction_demo.py [--out DIR] [--seed N]
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

warnings.filterwarnings("ignore", message="HookedTransformer is deprecated")

from transformer_lens import HookedTransformer, HookedTransformerConfig  # noqa: E402

import safelens  # noqa: E402

VOCAB = 48  # token 0 is BOS; 1..VOCAB are the random tokens
SEGMENT = 12  # longest repeated segment in training
BOS = 0


def build_model(seed: int) -> HookedTransformer:
    cfg = HookedTransformerConfig(
        n_layers=2,
        d_model=64,
        n_ctx=2 * SEGMENT + 1,
        d_head=16,
        n_heads=4,
        d_vocab=VOCAB + 1,
        attn_only=True,
        act_fn="gelu",
        normalization_type="LN",
        positional_embedding_type="standard",
        seed=seed,
        device="cpu",
    )
    return HookedTransformer(cfg)


def repeated(n: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """`[n, 1 + 2 * length]`: BOS, a random segment, the same segment again."""
    half = torch.randint(1, VOCAB + 1, (n, length), generator=generator)
    return torch.cat([torch.full((n, 1), BOS), half, half], dim=1)


def repeat_accuracy(model: HookedTransformer, tokens: torch.Tensor, length: int) -> float:
    """How often the model predicts the second copy's tokens (after its first)."""
    with torch.no_grad():
        predicted = model(tokens)[:, length + 1 : -1].argmax(-1)
    return (predicted == tokens[:, length + 2 :]).float().mean().item()


def train(model: HookedTransformer, seed: int, max_steps: int = 1500) -> tuple[int, float]:
    """Train on repeated segments of random length until held-out accuracy >= 0.95."""
    generator = torch.Generator().manual_seed(seed)
    held_out = repeated(256, 10, torch.Generator().manual_seed(seed + 1))
    optimiser = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    accuracy = 0.0
    bar = tqdm(range(1, max_steps + 1), desc="training", unit="step", leave=False, disable=None)
    for step in bar:
        length = int(torch.randint(4, SEGMENT + 1, (1,), generator=generator))
        tokens = repeated(64, length, generator)
        log_probs = model(tokens)[:, length + 1 : -1].log_softmax(-1)
        loss = -log_probs.gather(-1, tokens[:, length + 2 :, None]).mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        if step % 50 == 0:
            accuracy = repeat_accuracy(model, held_out, 10)
            bar.set_postfix(loss=f"{loss.item():.3f}", accuracy=f"{accuracy:.2f}")
            if accuracy >= 0.95:
                break
    bar.close()
    return step, accuracy


def locate(model: HookedTransformer, seed: int, out: Path) -> str:
    """(a) Key/value patching sweeps from a clean into a corrupted repeat."""
    generator = torch.Generator().manual_seed(seed + 2)
    segment = torch.randperm(VOCAB, generator=generator)[:10] + 1
    clean = torch.cat([torch.tensor([BOS]), segment, segment[:-1]])[None]
    wrong = int(segment[0])  # a token of the segment, but not the one that comes next
    corrupted = clean.clone()
    corrupted[0, len(segment)] = wrong  # the first copy's last token is changed
    answer = int(segment[-1])
    with torch.no_grad():
        clean_logits, clean_cache = model.run_with_cache(clean)
        corrupted_logits = model(corrupted)
    metric = safelens.logit_diff_metric(clean_logits, corrupted_logits, answer, wrong)
    labels = [str(t) for t in clean[0].tolist()]
    lines, peaks = [], {}
    for name, sweep in (
        ("keys", safelens.get_act_patch_attn_head_k_by_pos),
        ("values", safelens.get_act_patch_attn_head_v_by_pos),
    ):
        with torch.no_grad():
            result = sweep(model, corrupted, clean_cache, metric, progress=False)
        peaks[name] = float(result.abs().max())
        path = out / f"patching_{name}_by_pos.png"
        safelens.plot_patching_heatmap(
            result, labels=labels, title=f"patching clean {name} into the corrupted run", path=path
        )
        layer, pos, head = divmod_3(int(result.abs().argmax()), result.shape)
        lines.append(
            f"  {name:6}: strongest at layer {layer}, head {head}, position {pos} "
            f"(metric {result[layer, pos, head].item():+.2f})  -> {path}"
        )
    if peaks["keys"] < 0.25 * peaks["values"]:
        # The corruption changes which token the first copy holds, not the token before
        # it that induction matches on: where attention looks is unchanged, what it
        # copies is not.
        lines.append(
            "  the corruption changes what the continuation copies (values), "
            "not where its attention looks (keys)"
        )
    return "\n".join(lines)


def divmod_3(flat: int, shape: torch.Size) -> tuple[int, int, int]:
    layer, rest = divmod(flat, shape[1] * shape[2])
    pos, head = divmod(rest, shape[2])
    return layer, pos, head


def ablate(model: HookedTransformer, prefix_tokens: torch.Tensor, rest: torch.Tensor) -> str:
    """(b) Zero one head's cached prefix keys/values at a time, read-time."""
    prefix = safelens.prefill(model, prefix_tokens)
    snapshot = [(e.keys.clone(), e.values.clone()) for e in prefix.cache]
    base = safelens.score_continuations(model, prefix, [rest]).sums.item()
    drops = {}
    for layer in range(model.cfg.n_layers):
        for head in range(model.cfg.n_heads):
            ablated = safelens.ablate_read(
                prefix, safelens.Ablation("zero", layers=layer, heads=head)
            )
            score = safelens.score_continuations(model, ablated, [rest]).sums.item()
            drops[(layer, head)] = base - score
    unchanged = all(
        torch.equal(e.keys, k) and torch.equal(e.values, v)
        for e, (k, v) in zip(prefix.cache, snapshot, strict=True)
    )
    (layer, head), drop = max(drops.items(), key=lambda item: item[1])
    table = "  ".join(f"L{lyr}H{hd}:{d:5.1f}" for (lyr, hd), d in drops.items())
    return (
        f"  log p(continuation) = {base:.2f} unablated\n"
        f"  drop when zeroing one head's cached keys+values: {table}\n"
        f"  the continuation relies most on layer {layer} head {head} "
        f"(log-prob drops by {drop:.1f}); prefix bitwise unchanged: {unchanged}"
    )


def compare(model: HookedTransformer, prefix_tokens: torch.Tensor, rest: torch.Tensor) -> str:
    """(c) Several continuations of one frozen prefix, scored together; then generate."""
    prefix = safelens.prefill(model, prefix_tokens)
    shuffled = rest[torch.randperm(len(rest), generator=torch.Generator().manual_seed(0))]
    candidates = {
        "the repeat": rest,
        "the repeat, one token changed": torch.cat([rest[:2], (rest[2:3] % VOCAB) + 1, rest[3:]]),
        "the repeat, shuffled": shuffled,
        "the repeat, skipping a token": rest[1:],
    }
    scores = safelens.score_continuations(model, prefix, list(candidates.values()))
    full = torch.cat([prefix_tokens[0], rest])[None]
    with torch.no_grad():
        reference = model(full).log_softmax(-1)[0, prefix_tokens.shape[1] - 1 : -1]
    expected = reference.gather(-1, rest[:, None]).sum().item()
    lines = [
        f"  {name:31}: log p = {score:7.2f}"
        for name, score in zip(candidates, scores.sums.tolist(), strict=True)
    ]
    lines.append(
        f"  (uncached full run of the repeat: {expected:.2f}; "
        f"max abs difference {abs(expected - scores.sums[0].item()):.1e})"
    )
    generated = safelens.generate(model, prefix, len(rest))
    lines.append(
        f"  greedy generation from the frozen prefix reproduces the repeat: "
        f"{torch.equal(generated.tokens[0], rest)}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("safelens-demo"), help="figure folder")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    model = build_model(args.seed)
    steps, accuracy = train(model, args.seed)
    model.eval()
    print(
        f"1. trained a 2-layer attention-only model: {steps} steps, repeat accuracy {accuracy:.2f}"
    )

    with torch.no_grad():
        print("2a. where is the mechanism? key/value patching sweeps")
        print(locate(model, args.seed, args.out))

        generator = torch.Generator().manual_seed(args.seed + 3)
        segment = torch.randperm(VOCAB, generator=generator)[:10] + 1
        prefix_tokens = torch.cat([torch.tensor([BOS]), segment, segment[:3]])[None]
        rest = segment[3:]
        print("2b. which head's cached keys/values does the continuation read?")
        print(ablate(model, prefix_tokens, rest))
        print("2c. counterfactual continuations of one frozen prefix")
        print(compare(model, prefix_tokens, rest))
    print(f"figures written to {args.out.resolve()}")


if __name__ == "__main__":
    main()

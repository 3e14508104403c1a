"""Memory of N continuations of one prefix: safelens branches vs N separate TL caches.

One more row: a sliding-window model (Mistral-like, window shorter than the context) run
with `HFKeyValueCache(config=)` against `DynamicCache(config=)`, which keeps only each
layer's window: the same bytes held, the same logits.

The TransformerLens way to run N continuations of a P-token prefix from one cache is N
deep copies of its cache, one per continuation. safelens' `prefix.expand(N)` (one
batched forward) and `prefix.fork()` (one branch per continuation) share the prefix's
storage instead. Bytes are counted as unique storage: tensors are deduplicated by
`untyped_storage().data_ptr()` and each storage counted whole, spare capacity included.
Logits of every continuation are checked against the TransformerLens run.

    python -m benchmarks.bench_memory [--quick]
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Iterable
from typing import Literal

import torch
from transformer_lens import HookedTransformer
from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

from benchmarks._common import Row, rotary_model
from safelens import KeyValueCache

TARGET = "prefix keys/values stored once: N× less than N separate caches"
SLIDING_TARGET = "sliding-window layers: no more bytes than DynamicCache"
NEW_TOKENS = 8
TOLERANCE = 1e-4


def _unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _safelens_tensors(cache: KeyValueCache) -> list[torch.Tensor]:
    # The pieces each sequence is stored in (a joined `entry.keys` would be a fresh copy).
    held = [entry._keys for entry in cache] + [entry._values for entry in cache]
    held.append(cache._mask)
    return [piece for sequence in held for piece in sequence.pieces()]


def _tl_tensors(cache: TransformerLensKeyValueCache) -> list[torch.Tensor]:
    tensors = [t for entry in cache.entries for t in (entry.past_keys, entry.past_values)]
    return tensors + [cache.previous_attention_mask]


def _ones(batch: int, length: int) -> torch.Tensor:
    return torch.ones(batch, length, dtype=torch.long)


def _tl_continuations(
    model: HookedTransformer, prefix: TransformerLensKeyValueCache, continuations: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """N deep copies of the TL prefix cache, each running one continuation."""
    caches = [copy.deepcopy(prefix) for _ in range(continuations.shape[0])]
    for cache in caches:
        cache.unfreeze()
    logits = [
        model(row[None], past_kv_cache=cache, attention_mask=_ones(1, NEW_TOKENS))
        for row, cache in zip(continuations, caches, strict=True)
    ]
    return torch.cat(logits), _unique_bytes(t for c in caches for t in _tl_tensors(c))


def _row(
    model: HookedTransformer,
    ours: KeyValueCache,
    theirs: TransformerLensKeyValueCache,
    n: int,
    prefix_bytes: int,
    branching: Literal["expand", "fork"],
) -> Row:
    """Bytes held by `n` continuations branched from `ours`, against `n` TL caches."""
    continuations = torch.randint(0, model.cfg.d_vocab, (n, NEW_TOKENS), generator=_seeded(n))
    if branching == "expand":
        branches, inputs = [ours.expand(n)], [continuations]
    else:
        branches, inputs = [ours.fork() for _ in range(n)], list(continuations[:, None])
    logits = torch.cat(
        [
            model(tokens, past_kv_cache=branch, attention_mask=_ones(*tokens.shape))
            for tokens, branch in zip(inputs, branches, strict=True)
        ]
    )
    ours_bytes = _unique_bytes(t for b in branches for t in _safelens_tensors(b))
    reference, tl_bytes = _tl_continuations(model, theirs, continuations)
    difference = (logits - reference).abs().max().item()
    shared = all(ours.storages() <= branch.storages() for branch in branches)
    how = f"expand({n})" if branching == "expand" else f"{n} forks"
    return Row(
        job=f"{n} continuations of {NEW_TOKENS} tokens, {how}",
        safelens=ours_bytes,
        reference=tl_bytes,
        unit="bytes",
        agree=difference <= TOLERANCE and shared,
        target=TARGET,
        note=f"prefix {prefix_bytes} bytes held once vs {n}×; max abs logit diff {difference:.1e}",
        group="continuations" if branching == "expand" else "",
        x=n if branching == "expand" else None,
    )


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _sliding_window_row(quick: bool) -> Row:
    """Bytes an HF sliding-window model's cache holds after a long prompt and 16 steps."""
    import transformers
    from transformers import DynamicCache

    from safelens import HFKeyValueCache, hf_cache_argument

    length, window = (64, 16) if quick else (1024, 128)
    config = transformers.MistralConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=1000, sliding_window=window,
    )  # fmt: skip
    torch.manual_seed(0)
    lm = transformers.MistralForCausalLM(config).eval()
    tokens = torch.randint(0, config.vocab_size, (1, length + 16), generator=_seeded(1))
    caches = {"safelens": HFKeyValueCache(config=config), "hf": DynamicCache(config=config)}
    logits: dict[str, list[torch.Tensor]] = {name: [] for name in caches}
    argument = hf_cache_argument(lm)
    with torch.no_grad():
        for name, cache in caches.items():
            for start, stop in [(0, length), *((i, i + 1) for i in range(length, length + 16))]:
                out = lm(tokens[:, start:stop], use_cache=True, **{argument: cache})
                logits[name].append(out.logits)
    held = {
        name: _unique_bytes(t for layer in cache.layers for t in (layer.keys, layer.values))
        for name, cache in caches.items()
    }
    difference = max(
        (a - b).abs().max().item() for a, b in zip(logits["safelens"], logits["hf"], strict=True)
    )
    return Row(
        job=f"sliding window {window}, {length} + 16 tokens (Mistral-like, 4 layers)",
        safelens=held["safelens"],
        reference=held["hf"],
        unit="bytes",
        agree=difference <= TOLERANCE,
        target=SLIDING_TARGET,
        note=f"vs DynamicCache(config=); max abs logit diff {difference:.1e}",
    )


def run(quick: bool = False) -> list[Row]:
    """Rows for N in (1, 8, 32, 128) with `expand`, one for 32 forks, one sliding window."""
    prefix_length = 64 if quick else 512
    model = rotary_model()
    prompt = torch.randint(0, model.cfg.d_vocab, (1, prefix_length), generator=_seeded(0))
    with torch.no_grad():
        ours = KeyValueCache.init_cache(model.cfg, "cpu")
        model(prompt, past_kv_cache=ours, attention_mask=_ones(1, prefix_length))
        ours.freeze()
        theirs = TransformerLensKeyValueCache.init_cache(model.cfg, "cpu", 1)
        model(prompt, past_kv_cache=theirs, attention_mask=_ones(1, prefix_length))
        theirs.freeze()
        prefix_bytes = _unique_bytes(_safelens_tensors(ours))
        rows = [_row(model, ours, theirs, n, prefix_bytes, "expand") for n in (1, 8, 32, 128)]
        rows.append(_row(model, ours, theirs, 32, prefix_bytes, "fork"))
    for row in rows:
        row.job = f"P={prefix_length}: {row.job}"
    return [*rows, _sliding_window_row(quick)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64-token prefix instead of 512")
    rows = run(quick=parser.parse_args().quick)
    print(f"{'job':<50} {'safelens MB':>12} {'TL MB':>10} {'ratio':>7} agree  note")
    for row in rows:
        print(
            f"{row.job:<50} {row.safelens / 2**20:>12.2f} {row.reference / 2**20:>10.2f} "
            f"{row.ratio:>6.1f}× {str(row.agree):<6} {row.note}"
        )
    print(f"target: {TARGET}")


if __name__ == "__main__":
    main()

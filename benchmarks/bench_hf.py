"""HuggingFace rows: safelens against HuggingFace's own ways, on a Llama-like GQA model.

The model: a random-weight `LlamaForCausalLM`, 4 layers, d_model 256, 8 query heads
sharing 2 key/value heads, `sdpa` attention, on the CPU (`--quick`: 2 layers, d_model
64, and small sizes). Rows, each run side by side on
the same model and inputs, numbers checked to agree in the run:

- N continuations of a prefix: safelens (`prefill` + `score_continuations`, whose
  batches read the broadcast prefix once per layer under `shared_prefix`) against one HF
  forward per prefix + continuation, and against HF's own best way: a `DynamicCache`
  prefill, `batch_repeat_interleave(N)`, one batched forward. Log-probabilities agree to
  `TOLERANCE`.
- Memory of N continuations: `expand(N)` of a prefix `HFKeyValueCache` (which then
  stores each row's own tokens) against N `DynamicCache` copies of the prefix, each
  continued by one row; unique storage bytes, logits checked.
- Greedy generation: safelens `prefill` + `generate` against HF `generate` with its
  `DynamicCache`, and HF `generate` given an `HFKeyValueCache` against the same; the
  generated tokens must be identical.
- The continuation and generation rows again through a `TransformerBridge` booted
  offline over the same weights (the one-forward-each reference is then the bridge's
  own forward; HF's best way and `generate` run on the plain HF model). With no hook
  attached to the bridge, safelens runs these passes on the bridge's plain HuggingFace
  model (the same parameter tensors without the bridge's components, so
  `shared_prefix` applies), after checking one pass of the prefix's last token against
  the bridge; with a hook attached every pass goes through the bridge's own components.

Each time is the best of 5 runs after a warm-up, safelens' and the reference's runs
taken in turn (`best_times`), so that the machine's drift does not favour either.

Run: `python -m benchmarks.bench_hf [--quick]`.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import transformers
from transformers import DynamicCache

from benchmarks._common import Row, best_time, best_times
from safelens import HFKeyValueCache, generate, hf_cache_argument, prefill, score_continuations

TARGET_NAIVE = "≥15× faster than one forward per prefix+continuation"
TARGET_BEST = (
    "≥1× (aim 1.5×) HF's own best way: DynamicCache prefill, batch_repeat_interleave, "
    "one batched forward"
)
TARGET_MEMORY = "prefix keys/values stored once: N× less than N DynamicCaches"
TARGET_GENERATE = "≥0.95× HF generate with its DynamicCache, identical tokens"
TOLERANCE = 1e-4
BRIDGE = "TransformerBridge over HF Llama"
VOCAB = 1000


@dataclass(frozen=True)
class Sizes:
    hidden: int
    layers: int
    prefix: int
    rows: int
    new: int
    prompt: int
    generated: int
    repeats: int
    warmup: int


FULL = Sizes(
    hidden=256,
    layers=4,
    prefix=512,
    rows=32,
    new=8,
    prompt=1024,
    generated=512,
    repeats=5,
    warmup=1,
)
QUICK = Sizes(
    hidden=64, layers=2, prefix=32, rows=4, new=4, prompt=16, generated=8, repeats=1, warmup=0
)


def llama_model(sizes: Sizes = FULL, seed: int = 0, device: str = "cpu") -> torch.nn.Module:
    """The SPEC §3 HF benchmark model: a random-weight Llama-like GQA causal LM on `device`."""
    config = transformers.LlamaConfig(
        hidden_size=sizes.hidden,
        intermediate_size=4 * sizes.hidden,
        num_hidden_layers=sizes.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        vocab_size=VOCAB,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(device).eval()


def _inputs(sizes: Sizes, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, VOCAB, (sizes.prefix,), generator=generator)
    continuations = torch.randint(1, VOCAB, (sizes.rows, sizes.new), generator=generator)
    return prompt, continuations


def _time(fn: Callable[[], object], sizes: Sizes, warmup: int | None = None) -> float:
    return best_time(fn, sizes.repeats, sizes.warmup if warmup is None else warmup)


def _gathered(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logits.float().log_softmax(-1).gather(-1, tokens[..., None])[..., 0]


# -- continuations ---------------------------------------------------------------------


def _safelens(model, prompt, continuations) -> torch.Tensor:
    prefix = prefill(model, prompt, keep_residuals=False)
    return score_continuations(model, prefix, continuations).log_probs


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of an uncached forward (a bridge returns them, an HF model an output)."""
    out = model(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


def _naive(model, prompt, continuations) -> torch.Tensor:
    start = len(prompt) - 1
    rows = [
        _gathered(_logits(model, torch.cat([prompt, row])[None])[0, start:-1], row)
        for row in continuations
    ]
    return torch.stack(rows)


def _hf_best(model, prompt, continuations) -> torch.Tensor:
    """HF's own way: prefill a DynamicCache, repeat it per row, one batched forward."""
    name = hf_cache_argument(model)
    cache = DynamicCache(config=model.config)
    first = model(prompt[None], use_cache=True, **{name: cache}).logits[:, -1]
    cache.batch_repeat_interleave(continuations.shape[0])
    logits = model(continuations, use_cache=True, **{name: cache}).logits
    logits = torch.cat([first.expand(len(continuations), -1)[:, None], logits[:, :-1]], dim=1)
    return _gathered(logits, continuations)


def _difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def continuation_rows(model, hf_model, sizes: Sizes, label: str) -> list[Row]:
    """safelens' continuations on `model` against one forward of `model` each, and
    against HF's best way on `hf_model` (the same weights), on `hf_model`'s device."""
    prompt, continuations = (t.to(hf_model.device) for t in _inputs(sizes))
    ours = _safelens(model, prompt, continuations)
    naive = _naive(model, prompt, continuations)
    best = _hf_best(hf_model, prompt, continuations)
    t_ours, t_best = best_times(
        [
            lambda: _safelens(model, prompt, continuations),
            lambda: _hf_best(hf_model, prompt, continuations),
        ],
        sizes.repeats,
        sizes.warmup,
    )
    t_naive = _time(lambda: _naive(model, prompt, continuations), sizes, warmup=0)
    job = f"{label}: {sizes.rows} continuations × {sizes.new} tokens after {sizes.prefix}"
    return [
        Row(
            f"{job}: vs one forward each",
            t_ours,
            t_naive,
            "s",
            _difference(ours, naive) <= TOLERANCE,
            TARGET_NAIVE,
            note=f"max abs log-prob diff {_difference(ours, naive):.1e}",
        ),
        Row(
            f"{job}: vs DynamicCache + batch_repeat_interleave + one batched forward",
            t_ours,
            t_best,
            "s",
            _difference(ours, best) <= TOLERANCE,
            TARGET_BEST,
            note=f"max abs log-prob diff {_difference(ours, best):.1e}",
        ),
    ]


# -- memory ----------------------------------------------------------------------------


def _unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _safelens_tensors(cache: HFKeyValueCache) -> list[torch.Tensor]:
    # The pieces each sequence is stored in (a joined `layer.keys` would be a fresh copy).
    held = [s for layer in cache.layers for s in (layer._keys, layer._values) if s is not None]
    return [piece for sequence in held for piece in sequence.pieces()]


def memory_row(model, sizes: Sizes) -> Row:
    """Bytes held by N continuations of one prefix: `expand(N)` against N DynamicCaches."""
    name = hf_cache_argument(model)
    prompt, continuations = _inputs(sizes)
    ours = HFKeyValueCache(model.config)
    theirs = DynamicCache(config=model.config)
    model(prompt[None], use_cache=True, **{name: ours})
    model(prompt[None], use_cache=True, **{name: theirs})
    ours.freeze()
    prefix_bytes = _unique_bytes(_safelens_tensors(ours))
    rows = ours.expand(sizes.rows)
    logits = model(continuations, use_cache=True, **{name: rows}).logits
    copies = [copy.deepcopy(theirs) for _ in continuations]
    reference = torch.cat(
        [
            model(row[None], use_cache=True, **{name: cache}).logits
            for row, cache in zip(continuations, copies, strict=True)
        ]
    )
    their_bytes = _unique_bytes(
        t for c in copies for layer in c.layers for t in (layer.keys, layer.values)
    )
    difference = _difference(logits, reference)
    shared = ours.storages() <= rows.storages()
    return Row(
        f"HF Llama: {sizes.rows} continuations of {sizes.new} tokens after {sizes.prefix}, "
        f"expand({sizes.rows}) vs {sizes.rows} DynamicCaches",
        _unique_bytes(_safelens_tensors(rows)),
        their_bytes,
        "bytes",
        difference <= TOLERANCE and shared,
        TARGET_MEMORY,
        note=f"prefix {prefix_bytes} bytes held once vs {sizes.rows}×; "
        f"max abs logit diff {difference:.1e}",
    )


# -- generation ------------------------------------------------------------------------


def _safelens_generate(model, prompt: torch.Tensor, new: int) -> torch.Tensor:
    return generate(model, prefill(model, prompt, keep_residuals=False), new).tokens[0]


def _hf_generate(model, prompt: torch.Tensor, new: int, cache: object = None) -> torch.Tensor:
    kwargs = {} if cache is None else {hf_cache_argument(model): cache}
    out = model.generate(prompt[None], max_new_tokens=new, do_sample=False, **kwargs)
    return out[0, len(prompt) :]


def _prompt(sizes: Sizes) -> torch.Tensor:
    return torch.randint(1, VOCAB, (sizes.prompt,), generator=torch.Generator().manual_seed(1))


def generation_row(model, hf_model, sizes: Sizes, label: str) -> Row:
    """Greedy generation: safelens' on `model` against HF `generate` on `hf_model`."""
    prompt, new = _prompt(sizes).to(hf_model.device), sizes.generated
    theirs = _hf_generate(hf_model, prompt, new)
    ours = _safelens_generate(model, prompt, new)
    t_theirs, t_ours = best_times(
        [
            lambda: _hf_generate(hf_model, prompt, new),
            lambda: _safelens_generate(model, prompt, new),
        ],
        sizes.repeats,
        sizes.warmup,
    )
    return Row(
        f"{label}: greedy generation, {sizes.prompt}-token prompt + {new} new tokens: "
        "safelens generate vs HF generate",
        t_ours,
        t_theirs,
        "s",
        torch.equal(ours, theirs),
        TARGET_GENERATE,
    )


def hf_generate_row(model, sizes: Sizes) -> Row:
    """HF `generate` given an `HFKeyValueCache`, against the same with its DynamicCache."""
    prompt, new = _prompt(sizes).to(model.device), sizes.generated
    theirs = _hf_generate(model, prompt, new)
    ours = _hf_generate(model, prompt, new, HFKeyValueCache(model.config))
    t_theirs, t_ours = best_times(
        [
            lambda: _hf_generate(model, prompt, new),
            lambda: _hf_generate(model, prompt, new, HFKeyValueCache(model.config)),
        ],
        sizes.repeats,
        sizes.warmup,
    )
    return Row(
        f"HF Llama: greedy generation, {sizes.prompt}-token prompt + {new} new tokens: "
        "HF generate with HFKeyValueCache vs with DynamicCache",
        t_ours,
        t_theirs,
        "s",
        torch.equal(ours, theirs),
        TARGET_GENERATE,
    )


# -- TransformerBridge -----------------------------------------------------------------


def bridge_model(sizes: Sizes, device: str = "cpu") -> torch.nn.Module:
    """A TransformerBridge over `llama_model(sizes)`'s weights, booted offline.

    Booting needs a tokenizer folder: a word-level one (token `i` is `"t{i}"`) is saved
    to a temporary folder. Booting replaces the HF model's attention in place, so the
    bridge gets an HF model of its own.
    """
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformer_lens.model_bridge import TransformerBridge

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")),
        bos_token="t0",
        unk_token="t1",
    )
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        bridge = TransformerBridge.boot_transformers(
            folder, hf_model=llama_model(sizes, device=device), device=device
        )
    bridge.eval()
    return bridge


def run(quick: bool = False) -> list[Row]:
    """The benchmark rows (quick: tiny sizes, one repeat)."""
    sizes = QUICK if quick else FULL
    model = llama_model(sizes)
    bridge = bridge_model(sizes)
    with torch.no_grad():
        rows = continuation_rows(model, model, sizes, "HF Llama")
        rows.append(memory_row(model, sizes))
        rows.append(generation_row(model, model, sizes, "HF Llama"))
        rows.append(hf_generate_row(model, sizes))
        bridged = continuation_rows(bridge, model, sizes, BRIDGE)
        bridged.append(generation_row(bridge, model, sizes, BRIDGE))
    for row in bridged:
        row.note = f"{row.note}; no hook attached: passes on the bridge's plain HF model"
    return rows + bridged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run for development")
    args = parser.parse_args()
    print(f"{'job':<110} {'ratio':>8}  agree  target")
    for row in run(quick=args.quick):
        print(f"{row.job:<110} {row.ratio:>7.2f}×  {str(row.agree):<5}  {row.target}")


if __name__ == "__main__":
    main()

"""Patching grids on plain HuggingFace models: safelens against nnsight and pyvene.

The models: random-weight `LlamaForCausalLM` (GQA: 8 query heads, 2 key/value heads) and
`GPT2LMHeadModel`, 4 layers, d_model 256, on the CPU (`--quick`: 2 layers, d_model 64),
at 32 and 128 tokens (`--quick`: 8). Each exact by-position grid (`resid_pre`,
`attn_out`, `mlp_out`, keys, values, queries, head outputs `z`) is computed three ways
in one process, on the same weights and prompts (two independent random prompts, which
share no activation), with the metric a last-position logit difference; the numbers
must agree to 1e-4. Each library gets its own copy of the model: nnsight's wrapper
replaces the forward of every module it is given (a model it wrapped runs every other
library's passes through its machinery), and pyvene freezes the parameters. Times are
the best of 5 runs (`--quick`: 1), safelens' and the peers' taken in turn so that the
machine's drift falls evenly on them; a peer's run over 2 s is timed once.

- safelens: its `get_act_patch_*` sweep, the clean cache from `run_with_patching_cache`,
  the metric declared last-position-only (as `logit_diff_metric` declares it).
- nnsight 0.8.1, the way its docs batch interventions: one `TransformersModel` over its
  copy of the HF model; the clean activations saved in one trace; then each trace runs a batch
  of corrupted copies as one invoke, row `i` being grid cell `i`, and for each layer in
  forward order one indexed write puts the clean activation at every row's position
  (and head) of that layer: `layers[l].input` (`resid_pre`), the attention module's
  output (`attn_out`), `mlp.output`, the key, value or query projection's output and
  the output projection's input (`z`), heads sliced from the projection (GPT-2: from
  `c_attn`). Only the last position's logits are saved. Traces hold at most
  `ROWS_PER_PASS` rows.
- pyvene 0.1.8, the way its docs patch: per layer one `IntervenableModel` with a
  `VanillaIntervention` on the site's component (`block_input`, `attention_output`,
  `mlp_output`, `head_key_output`, `head_value_output`, `head_query_output`,
  `head_attention_value_output`), unit `pos` or `h.pos`; a batch of corrupted copies
  as `base` and of clean copies as the source, one grid cell per row in the batched
  `unit_locations`. Batches hold at most `ROWS_PER_PASS` rows.

Attribution patching of `resid_pre`, `attn_out`, `mlp_out`, keys and values: safelens'
`attribution_patch` without and with the QK fix, against nnsight written by hand as its
docs show gradients: one trace of the clean prompt saving the sites; one trace of the
corrupted prompt saving them, the metric's `.backward()` and each site's `.grad`; the
estimate `(clean - corrupted) · grad` summed over `d_model` (over `d_head` per head),
plus the corrupted metric. Without the QK fix the two must agree to 1e-4. Targets: ≥1×
nnsight without the fix, at most 2× its time with it.

Keys are patched before the rotary embedding by the peers and after it by safelens:
for a patch at one position the same patch. Every grid must run: a grid or attribution
safelens refuses raises its `PatchingError` and ends the run. Target: every grid ≥3× each
peer.

Run: `python -m benchmarks.bench_peers [--quick]`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import transformers

from benchmarks._common import Row, best_time, best_times, declared_logit_difference
from safelens import run_with_patching_cache

TARGET = "≥3× {peer}'s fastest way, ≤1e-4"
VOCAB = 1000
ROWS_PER_PASS = 256
# activation -> (safelens sweep, pyvene component, heads: None, "kv" or "q")
SITES = {
    "resid_pre": ("get_act_patch_resid_pre", "block_input", None),
    "attn_out": ("get_act_patch_attn_out", "attention_output", None),
    "mlp_out": ("get_act_patch_mlp_out", "mlp_output", None),
    "k": ("get_act_patch_attn_head_k_by_pos", "head_key_output", "kv"),
    "v": ("get_act_patch_attn_head_v_by_pos", "head_value_output", "kv"),
    "q": ("get_act_patch_attn_head_q_by_pos", "head_query_output", "q"),
    "z": ("get_act_patch_attn_head_out_by_pos", "head_attention_value_output", "q"),
}


@dataclass(frozen=True)
class Sizes:
    hidden: int
    layers: int
    lengths: tuple[int, ...]
    repeats: int


FULL = Sizes(hidden=256, layers=4, lengths=(32, 128), repeats=5)
QUICK = Sizes(hidden=64, layers=2, lengths=(8,), repeats=1)


def model_of(family: str, sizes: Sizes, seed: int = 0) -> torch.nn.Module:
    """A random-weight Llama-like (GQA) or GPT-2-like causal LM of `sizes`."""
    special = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=None, pad_token_id=None)
    if family == "llama":
        config: Any = transformers.LlamaConfig(
            hidden_size=sizes.hidden,
            intermediate_size=4 * sizes.hidden,
            num_hidden_layers=sizes.layers,
            num_attention_heads=8,
            num_key_value_heads=2,
            **special,
        )
    else:
        config = transformers.GPT2Config(
            n_embd=sizes.hidden, n_layer=sizes.layers, n_head=8, n_positions=1024, **special
        )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _tokenizer() -> Any:
    """A word-level tokenizer (token `i` is `"t{i}"`): nnsight's wrapper wants one."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {f"t{i}": i for i in range(VOCAB)}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")),
        bos_token="t0",
        unk_token="t1",
    )


def _heads(model: torch.nn.Module, kind: str | None) -> int:
    config = model.config
    if kind is None:
        return 1
    query = int(config.num_attention_heads)
    return int(getattr(config, "num_key_value_heads", None) or query) if kind == "kv" else query


def _cells(layers: int, length: int, heads: int) -> torch.Tensor:
    """Every grid cell `(layer, pos, head)`, in the order of the grid, `[cells, 3]`."""
    return torch.cartesian_prod(torch.arange(layers), torch.arange(length), torch.arange(heads))


def _metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[..., 3] - logits[..., 5]


# -- nnsight ----------------------------------------------------------------------------


class _Nnsight:
    """The sites of one family as nnsight envoys, and its grid (module notes)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from nnsight import TransformersModel

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.lm = TransformersModel(model, tokenizer=_tokenizer(), task="text-generation")
        self.model = model
        self.gpt2 = hasattr(model, "transformer")
        self.layers = self.lm.transformer.h if self.gpt2 else self.lm.model.layers
        config = model.config
        self.d_model = int(config.hidden_size)
        self.d_head = self.d_model // int(config.num_attention_heads)

    def read(self, activation: str, layer: int) -> Any:
        """The tensor that holds `activation` at `layer`, inside a trace (`[batch, pos, width]`)."""
        block = self.layers[layer]
        attention = block.attn if self.gpt2 else block.self_attn
        if activation == "resid_pre":
            return block.input
        if activation == "attn_out":
            return attention.output[0]
        if activation == "mlp_out":
            return block.mlp.output
        if activation == "z":
            return (attention.c_proj if self.gpt2 else attention.o_proj).input
        if self.gpt2:
            return attention.c_attn.output
        return getattr(attention, f"{activation}_proj").output

    def columns(self, activation: str, head: torch.Tensor) -> torch.Tensor:
        """The columns of `read`'s tensor that hold `head` of `activation`, `[cells, d_head]`."""
        offset = "qkv".index(activation) * self.d_model if self.gpt2 and activation in "qkv" else 0
        return offset + head[:, None] * self.d_head + torch.arange(self.d_head)

    def grid(
        self, activation: str, clean: torch.Tensor, corrupted: torch.Tensor, heads: int
    ) -> torch.Tensor:
        layers, length = len(self.layers), corrupted.shape[1]
        saved: dict[int, torch.Tensor] = {}
        with self.lm.trace(clean):
            for layer in range(layers):
                saved[layer] = self.read(activation, layer).save()
        cells = _cells(layers, length, heads)
        values = []
        for chunk in cells.split(ROWS_PER_PASS):
            with self.lm.trace(corrupted.expand(len(chunk), -1)):
                for layer in range(layers):
                    rows = (chunk[:, 0] == layer).nonzero()[:, 0]
                    if not len(rows):
                        continue
                    pos, head = chunk[rows, 1], chunk[rows, 2]
                    target = self.read(activation, layer)
                    if heads == 1 and activation in ("resid_pre", "attn_out", "mlp_out"):
                        target[rows, pos] = saved[layer][0, pos]
                    else:
                        columns = self.columns(activation, head)
                        target[rows[:, None], pos[:, None], columns] = saved[layer][
                            0, pos[:, None], columns
                        ]
                last = self.lm.lm_head.output[:, -1].save()
            values.append(_metric(last))
        return torch.cat(values).reshape(layers, length, heads)

    def attribution(
        self, activations: tuple[str, ...], clean: torch.Tensor, corrupted: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Attribution patching written by hand in nnsight (module notes), per activation
        the estimated metric of each patch, `[layer, pos, heads]`."""
        layers = len(self.layers)
        # One read per tensor, in forward order (GPT-2's q, k and v share `c_attn`).
        order = ("resid_pre", "q", "k", "v", "z", "attn_out", "mlp_out")
        tensor = {a: "qkv" if self.gpt2 and a in "qkv" else a for a in activations}
        reads: dict[tuple[int, str], str] = {}
        for layer in range(layers):
            for activation in sorted(activations, key=order.index):
                reads.setdefault((layer, tensor[activation]), activation)
        clean_saved: dict[tuple[int, str], torch.Tensor] = {}
        with torch.no_grad(), self.lm.trace(clean):
            for (layer, name), activation in reads.items():
                clean_saved[layer, name] = self.read(activation, layer).save()
        saved: dict[tuple[int, str], torch.Tensor] = {}
        grads: dict[tuple[int, str], torch.Tensor] = {}
        with torch.enable_grad(), self.lm.trace(corrupted):
            for (layer, name), activation in reads.items():
                saved[layer, name] = self.read(activation, layer).save()
            value = _metric(self.lm.lm_head.output[0, -1])
            baseline = value.save()
            with value.backward():
                for site in reversed(reads):
                    grads[site] = saved[site].grad.save()
        estimates = {}
        for activation in activations:
            per_layer = []
            for layer in range(layers):
                site = (layer, tensor[activation])
                delta = ((clean_saved[site] - saved[site]) * grads[site])[0]
                if activation in ("resid_pre", "attn_out", "mlp_out"):
                    per_layer.append(delta.sum(-1)[:, None])
                else:
                    heads = _heads(self.model, "kv" if activation in "kv" else "q")
                    columns = self.columns(activation, torch.arange(heads))
                    per_layer.append(delta[:, columns].sum(-1))
            estimates[activation] = baseline.detach() + torch.stack(per_layer).detach()
        return estimates


# -- pyvene -----------------------------------------------------------------------------


def pyvene_grid(
    model: torch.nn.Module,
    component: str,
    clean: torch.Tensor,
    corrupted: torch.Tensor,
    heads: int,
    by_head: bool,
) -> Callable[[], torch.Tensor]:
    """The grid by pyvene (module notes): set up once, then a function that computes it."""
    import pyvene as pv

    layers, length = model.config.num_hidden_layers, corrupted.shape[1]
    unit = "h.pos" if by_head else "pos"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = [
            pv.IntervenableModel(
                pv.IntervenableConfig(
                    [
                        pv.RepresentationConfig(
                            layer=layer,
                            component=component,
                            unit=unit,
                            max_number_of_units=1,
                            intervention_type=pv.VanillaIntervention,
                        )
                    ]
                ),
                model,
            )
            for layer in range(layers)
        ]
    cells = _cells(1, length, heads)

    def grid() -> torch.Tensor:
        values = []
        for layer in range(layers):
            for chunk in cells.split(ROWS_PER_PASS):
                pos = [[int(p)] for p in chunk[:, 1]]
                where: Any = [[[int(h)] for h in chunk[:, 2]], pos] if by_head else pos
                _, out = wrapped[layer](
                    base={"input_ids": corrupted.expand(len(chunk), -1)},
                    sources=[{"input_ids": clean.expand(len(chunk), -1)}],
                    unit_locations={"sources->base": ([where], [where])},
                )
                values.append(_metric(out.logits[:, -1]))
        return torch.cat(values).reshape(layers, length, heads)

    return grid


# -- rows -------------------------------------------------------------------------------

# A peer's run longer than this is timed once: its noise is small against its length.
_LONG_S = 2.0


def _timed_in_turn(
    ours: Callable[[], torch.Tensor], peers: dict[str, Callable[[], torch.Tensor]], repeats: int
) -> tuple[float, dict[str, tuple[torch.Tensor, float]]]:
    """safelens' best time, and each peer's result and best time, over `repeats` runs.

    Each peer runs once for its result (timed). Then safelens and every peer whose run
    took at most `_LONG_S` run in turn, `repeats` times (`best_times`): the machine's
    drift falls evenly on all of them, and a short run gets as many tries as the run it
    is compared with. A longer peer run keeps its one time: its noise is small against
    its length.
    """
    timed: dict[str, tuple[torch.Tensor, float]] = {}
    for name, theirs in peers.items():
        start = time.perf_counter()
        result = theirs()
        timed[name] = (result, time.perf_counter() - start)
    short = [name for name, (_, first) in timed.items() if first <= _LONG_S]
    best = best_times([ours, *(peers[name] for name in short)], repeats, warmup=0)
    for name, again in zip(short, best[1:], strict=True):
        result, first = timed[name]
        timed[name] = (result, min(first, again))
    return best[0], timed


def grid_rows(family: str, model: torch.nn.Module, length: int, sizes: Sizes) -> list[Row]:
    """One row per (grid, peer) at `length` tokens; a grid safelens refuses fails the run."""
    import safelens

    generator = torch.Generator().manual_seed(length)
    clean, corrupted = (torch.randint(1, VOCAB, (1, length), generator=generator) for _ in "ab")
    # Each library its own copy of the weights: nnsight's wrapper replaces every module's
    # forward, and pyvene freezes the parameters of the model it is given.
    peer = _Nnsight(copy.deepcopy(model))
    theirs_model = copy.deepcopy(model)
    rows = []
    with torch.no_grad():
        _, clean_cache = run_with_patching_cache(model, clean)
        for activation, (sweep_name, component, kind) in SITES.items():
            heads = _heads(model, kind)
            sweep = getattr(safelens, sweep_name)

            def ours(sweep: Any = sweep) -> torch.Tensor:
                return sweep(
                    model, corrupted, clean_cache, declared_logit_difference, progress=False
                )

            mine = ours().reshape(sizes.layers, length, heads)
            peers: dict[str, Callable[[], torch.Tensor]] = {
                "nnsight": lambda a=activation, h=heads: peer.grid(a, clean, corrupted, h),
                "pyvene": pyvene_grid(
                    theirs_model, component, clean, corrupted, heads, kind is not None
                ),
            }
            ours_s, timed = _timed_in_turn(ours, peers, sizes.repeats)
            for name, (result, theirs_s) in timed.items():
                diff = float((result - mine).abs().max())
                job = f"{activation} by-position grid, HF {family}, {length} tokens, vs {name}"
                note = f"max abs diff {diff:.1e}"
                rows.append(
                    Row(job, ours_s, theirs_s, "s", diff <= 1e-4, TARGET.format(peer=name), note)
                )
    return rows


ATTRIBUTED = ("resid_pre", "attn_out", "mlp_out", "k", "v")


def attribution_rows(family: str, model: torch.nn.Module, length: int, sizes: Sizes) -> list[Row]:
    """safelens' `attribution_patch` of `ATTRIBUTED`, without and with the QK fix, against
    nnsight's hand-written attribution of the same sites."""
    import safelens

    generator = torch.Generator().manual_seed(length)
    clean, corrupted = (torch.randint(1, VOCAB, (1, length), generator=generator) for _ in "ab")
    peer = _Nnsight(copy.deepcopy(model))  # its wrapper changes the model it is given
    with torch.no_grad():
        _, clean_cache = run_with_patching_cache(model, clean)

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return _metric(logits[:, -1]).sum()

    def ours(qk_fix: bool) -> Any:
        return safelens.attribution_patch(
            model, corrupted, clean_cache, metric, activations=ATTRIBUTED, qk_fix=qk_fix
        )

    unfixed = ours(False)
    theirs = peer.attribution(ATTRIBUTED, clean, corrupted)
    diff = max(
        float((unfixed.estimates[a].reshape(theirs[a].shape) - theirs[a]).abs().max())
        for a in ATTRIBUTED
    )
    theirs_s = best_time(lambda: peer.attribution(ATTRIBUTED, clean, corrupted), sizes.repeats, 0)
    job = f"attribution of {', '.join(ATTRIBUTED)}, HF {family}, {length} tokens, vs nnsight"
    rows = [
        Row(
            job,
            best_time(lambda: ours(False), sizes.repeats, 0),
            theirs_s,
            "s",
            diff <= 1e-4,
            "≥1× nnsight's hand-written attribution",
            f"max abs diff {diff:.1e}",
        )
    ]
    fixed_s = best_time(lambda: ours(True), sizes.repeats, 0)
    rows.append(
        Row(
            job.replace("attribution", "attribution with the QK fix"),
            fixed_s,
            theirs_s,
            "s",
            True,
            "≥0.5× nnsight's hand-written attribution (at most 2× its time)",
            "the QK fix changes k estimates by design; timed only",
        )
    )
    return rows


def rows(quick: bool = False, lengths: tuple[int, ...] | None = None) -> Iterator[Row]:
    """Every grid against both peers, on both families, at every length of the mode (or
    `lengths`), and the attribution rows, as they are measured.

    Each library runs its own copy of the same weights (`grid_rows`, `attribution_rows`):
    nnsight's wrapper replaces the forward of every module of the model it is given, and
    pyvene sets `requires_grad = False` on its parameters.
    """
    sizes = QUICK if quick else FULL
    if lengths:
        sizes = dataclasses.replace(sizes, lengths=lengths)
    for family in ("llama", "gpt2"):
        model = model_of(family, sizes)
        yield from attribution_rows(family, model, sizes.lengths[0], sizes)
        for length in sizes.lengths:
            yield from grid_rows(family, model, length, sizes)


def run(quick: bool = False) -> list[Row]:
    """`rows`, all of them."""
    return list(rows(quick))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run for development")
    parser.add_argument(
        "--lengths", type=int, nargs="+", help="prompt lengths to time (default: 32 and 128)"
    )
    args = parser.parse_args()
    print(f"{'job':<110} {'ratio':>8}  agree  note", flush=True)
    for row in rows(quick=args.quick, lengths=tuple(args.lengths or ())):
        print(f"{row.job:<110} {row.ratio:>7.2f}×  {str(row.agree):<5}  {row.note}", flush=True)


if __name__ == "__main__":
    main()

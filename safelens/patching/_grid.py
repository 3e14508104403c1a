"""How a sweep on a `HookedTransformer` runs its passes: many patched runs per forward pass.

Every sweep's loop (idle runs, the memory budget, the metric per run) is
`safelens.patching._engine`'s; here, the passes it runs on a `HookedTransformer`.

A patch at layer `l`, position `p` of a causal model changes nothing before layer `l`
and nothing before position `p`. So the patched runs of a sweep are grouped by `p`,
rounded down to a multiple of a span (`safelens.patching._grouping`, as on every
family); each group shares one frozen [`KeyValueCache`][safelens.KeyValueCache] of the
corrupted run cropped to that position, and runs only the positions from it through
the model.
Within a group, runs enter the model at their own layer: the batch starts at the lowest
patched layer from the corrupted run's residual stream, and the runs patched at each
later layer join the batch there (a staggered forward). The logits of positions `< p`
are the corrupted run's, copied in before the metric sees them.

Without a hook of the user's, an MLP's `gelu_new` runs as PyTorch's fused kernel
(`safelens.patching._fused`; in float32 and float64), and each block's `ln1`, which
TransformerLens calls three times on one tensor (the queries', keys' and values'
input), computes it once.

Positions are reused only where the plan allows it (a causal model; see
`safelens.patching._plan`): otherwise every run starts at position 0, still batched and
still entering at its own layer. The corrupted run, and every patched run, use the
attention mask TransformerLens' own forward would build for the tokens (the
tokenizer's leading padding masked when it pads on the left).

Threads: the sweep's hooks act only on the forward passes of the thread that runs the
sweep, and are removed by their own handles (`safelens.core._thread_hooks`), so sweeps in
several threads on one model, and other threads' plain forwards, do not see each
other's patches.

Caveat: the batch at the last layer holds every run of the chunk, so the memory
budget bounds the runs per chunk, not per layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from jaxtyping import Float, Int
from transformer_lens import HookedTransformer
from transformer_lens.hook_points import HookPoint
from transformer_lens.utilities import get_attention_mask
from transformer_lens.utilities.activation_functions import gelu_new

from ..backends._override import Replacement, overriding
from ..backends._sites import Site
from ..backends.hooked._shared_attention import shared_inputs, shared_prefix_attention
from ..core._cache import KeyValueCache
from ..core._thread_hooks import Hook, thread_hooks
from ..core._versions import version_of
from ._engine import Patcher, Planned, Run, Schedule
from ._fused import tanh_gelu
from ._grouping import groups, run_rows, with_positions_before
from ._limits import rows_within
from ._metric import Metric
from ._plan import Plan

__all__ = ["CorruptedRun", "HookedPasses", "Patcher", "Run"]

# Runs patched at positions `p0 … p0 + _SPAN - 1` share one chunk that starts at `p0`:
# fewer, larger forward passes, for a few positions recomputed per run.
_SPAN = 4


def _attention_mask_of(
    model: HookedTransformer, tokens: Int[torch.Tensor, "batch pos"]
) -> Int[torch.Tensor, "batch pos"] | None:
    """The mask TransformerLens' forward builds for `tokens`; `None` when it masks nothing."""
    tokenizer = model.tokenizer
    if tokenizer is None or tokenizer.padding_side != "left":
        return None
    mask = get_attention_mask(tokenizer, tokens, model.cfg.default_prepend_bos).to(tokens.device)
    return None if bool(mask.all()) else mask


@dataclass
class CorruptedRun:
    """What the corrupted run leaves for every patched run to reuse.

    `attention_mask` is `None` when every position is attended.
    """

    cache: KeyValueCache
    residuals: list[Float[torch.Tensor, "batch pos d_model"]]
    logits: Float[torch.Tensor, "batch pos d_vocab"]
    activations: dict[str, torch.Tensor]
    attention_mask: Int[torch.Tensor, "batch pos"] | None

    @classmethod
    def of(
        cls,
        model: HookedTransformer,
        tokens: Int[torch.Tensor, "batch pos"],
        activation_names: list[str],
    ) -> CorruptedRun:
        """Run `tokens` once into a frozen cache, keeping each layer's `resid_pre`."""
        n_layers = model.cfg.n_layers
        captured: dict[str, torch.Tensor] = {}

        def capture(tensor: torch.Tensor, hook: object) -> None:
            captured[hook.name] = tensor.detach()  # type: ignore[attr-defined]

        names = [f"blocks.{layer}.hook_resid_pre" for layer in range(n_layers)]
        names += [name for name in activation_names if name not in names]
        cache = KeyValueCache.init_cache(model.cfg, tokens.device, tokens.shape[0])
        mask = _attention_mask_of(model, tokens)
        full_mask = torch.ones_like(tokens) if mask is None else mask
        with thread_hooks([(model.hook_dict[name], capture) for name in names]):
            # Embedding apart from the blocks: given a cache, TransformerLens' embedding
            # asserts it holds n_key_value_heads heads, which is wrong for a model with
            # ungroup_grouped_query_attention=True (it caches n_heads).
            embedded = model(tokens, attention_mask=full_mask, stop_at_layer=0)
            logits = model(
                embedded, start_at_layer=0, past_kv_cache=cache, attention_mask=full_mask
            )
        cache.freeze()
        residuals = [captured[f"blocks.{layer}.hook_resid_pre"] for layer in range(n_layers)]
        return cls(cache, residuals, logits, captured, mask)


@dataclass
class HookedPasses:
    """A sweep's passes on a `HookedTransformer` (`safelens.patching._engine.Passes`).

    Its corrupted run is done (`corrupted`); `patcher` writes each run's patch at
    `hook_name(layer)`. `site` and `seen` are what the idle check reads (`None` and
    empty for a user's setter). With a `site` and every run at one position, each run's
    patch changes its own position `run.pos` alone (a by-position sweep), which lets
    some sites skip work (see `safelens.patching._plan`).
    """

    model: HookedTransformer
    corrupted: CorruptedRun
    hook_name: Callable[[int], str]
    patcher: Patcher
    site: Site | None
    seen: dict[int, torch.Tensor]

    @property
    def batch(self) -> int:
        return int(self.corrupted.logits.shape[0])

    def schedule(self, runs: list[Run], metric: Metric, max_bytes: int) -> Schedule:
        """The runs grouped into chunks from a position, each a staggered forward."""
        model, corrupted = self.model, self.corrupted
        length = corrupted.logits.shape[1]
        cfg = model.cfg

        def rows(start: int) -> int:
            return rows_within(
                max_bytes,
                d_vocab=cfg.d_vocab,
                d_model=cfg.d_model,
                d_mlp=cfg.d_mlp or 0,
                n_heads=cfg.n_heads,
                new=length - start,
                length=length,
                dtype=cfg.dtype,
            )

        last = cfg.n_layers - 1
        single_position = self.site is not None and all(run.pos is not None for run in runs)
        activation = self.hook_name(last).removeprefix(f"blocks.{last}.")
        plan = Plan.of(model, activation, single_position, metric)
        patch = _Patch(self.hook_name, self.patcher)
        span = _SPAN if plan.reuses_positions else length
        planned: list[Planned] = [
            (
                pos,
                group,
                functools.partial(_forward_chunk, model, corrupted, pos, patch=patch, plan=plan),
            )
            for pos, group in groups(runs, (span,))
        ]
        idle_logits = corrupted.logits[:, -1:] if plan.last_only else corrupted.logits
        return Schedule(planned, idle_logits, rows, _running(model, plan))


@contextmanager
def _running(model: HookedTransformer, plan: Plan) -> Iterator[None]:
    """Within the block, the passes' settings: no gradients, the shared prefix read
    once per layer, and (without a hook of the user's) the fused activation and each
    `ln1` computed once."""
    fused = _fused_activations(model) if plan.partial else {}
    once = {block.ln1: _once(block.ln1) for block in model.blocks} if plan.partial else {}
    with (
        torch.no_grad(),
        shared_prefix_attention(model),
        overriding(fused, "act_fn"),
        overriding(once),
    ):
        yield


def _once(norm: torch.nn.Module) -> Replacement:
    """`norm`'s output for the tensor it was last given, computed once while it is given it.

    A block hands its `ln1` the same tensor three times (the queries', keys' and values'
    input); without hooks inside `norm`, the three calls give the same numbers. A tensor
    edited in place since (its version moved) is computed again.
    """
    last: list[tuple[torch.Tensor, int, torch.Tensor]] = []  # (tensor, its version, output)
    points = [part for part in norm.modules() if isinstance(part, HookPoint)]

    def forward(own: Callable[..., torch.Tensor], *args: object, **kwargs: object) -> torch.Tensor:
        x = args[0] if len(args) == 1 and not kwargs else None
        hooked = any(point._forward_hooks or point._forward_pre_hooks for point in points)
        if not isinstance(x, torch.Tensor) or hooked:
            return own(*args, **kwargs)
        version = version_of(x)
        if version is None:  # an inference tensor: its edits are not counted
            return own(x)
        if last and last[0][0] is x and last[0][1] == version:  # not edited in place since
            return last[0][2]
        last[:] = [(x, version, own(x))]
        return last[0][2]

    return forward


def _fused_activations(model: HookedTransformer) -> dict[torch.nn.Module, Replacement]:
    """The MLPs whose `gelu_new` a pass runs fused (`safelens.patching._fused`)."""
    mlps = [block.mlp for block in model.blocks if hasattr(block, "mlp")]
    return {mlp: tanh_gelu for mlp in mlps if getattr(mlp, "act_fn", None) is gelu_new}


def _forward_chunk(
    model: HookedTransformer,
    corrupted: CorruptedRun,
    pos: int,
    chunk: list[Run],
    *,
    patch: _Patch,
    plan: Plan,
) -> Float[torch.Tensor, "rows pos d_vocab"]:
    """The logits of the chunk's runs (all patched at `pos` or later), `batch` rows per run.

    Positions `pos:` run through the model. Rows are in chunk order (the chunk is sorted
    by layer). With `plan.last_only` the logits are the last position's alone,
    `[rows, 1, d_vocab]`.
    """
    last = model.cfg.n_layers - 1
    layers = _Layers(model, corrupted, plan, pos)
    end = max(run.pos or 0 for run in chunk) + 1
    residual: torch.Tensor | None = None
    single_last: torch.Tensor | None = None
    for layer in range(chunk[0].layer, last + 1):
        runs = [run for run in chunk if run.layer == layer]
        joining: torch.Tensor | None = None
        if runs and plan.single_position:
            # Positions `pos:end` hold every patched position of these runs; later
            # positions keep the corrupted run's values through this layer.
            alone = corrupted.residuals[layer][:, pos:end].repeat(len(runs), 1, 1)
            alone = layers.run(alone, layer, patch, runs, 0)
            if layer < last:
                rest = corrupted.residuals[layer + 1][:, end:].repeat(len(runs), 1, 1)
                joining = torch.cat([alone, rest], dim=1)
            else:
                single_last = _single_position_logits(model, corrupted, pos, end, alone, plan)
            runs = []
        first = 0
        if runs:
            new = corrupted.residuals[layer][:, pos:].repeat(len(runs), 1, 1)
            first = 0 if residual is None else residual.shape[0]
            residual = new if residual is None else torch.cat([residual, new])
        if residual is not None:
            residual = layers.run(residual, layer, patch, runs, first)
        if joining is not None:
            residual = joining if residual is None else torch.cat([residual, joining])
    logits = []
    if residual is not None:
        logits.append(_logits(model, corrupted, pos, residual, plan))
    if single_last is not None:
        logits.append(single_last)
    return torch.cat(logits) if len(logits) > 1 else logits[0]


@dataclass(frozen=True)
class _Patch:
    """The sweep's patch: where it goes and what puts it there."""

    hook_name: Callable[[int], str]
    patcher: Patcher


class _Layers:
    """Runs one layer at a time on the chunk's cropped, frozen corrupted cache."""

    def __init__(
        self, model: HookedTransformer, corrupted: CorruptedRun, plan: Plan, start: int
    ) -> None:
        self.model = model
        self.prefix = corrupted.cache.crop(start)
        self.mask = corrupted.attention_mask
        self.batch = corrupted.logits.shape[0]
        self.plan = plan
        self.start = start

    def run(
        self, residual: torch.Tensor, layer: int, patch: _Patch, runs: list[Run], first: int
    ) -> torch.Tensor:
        """`residual` through `layer`, patching `runs` (their rows from `first`), if any."""
        model, batch = self.model, self.batch
        points: list[tuple[HookPoint, Hook]] = []
        if runs:
            places = list(range(first // batch, first // batch + len(runs)))

            def hook(tensor: torch.Tensor, hook: object) -> torch.Tensor:
                patch.patcher(tensor, runs, places, batch, self.start)
                return tensor

            points.append((model.hook_dict[patch.hook_name(layer)], hook))
        if layer == model.cfg.n_layers - 1:
            points += [(model.hook_dict[name], fn) for name, fn in self.plan.last_layer_trims]
        copies = residual.shape[0] // batch
        mask = None
        if self.mask is not None:
            mask = self.mask[:, : self.start + residual.shape[1]].repeat(copies, 1)
        shared = shared_inputs(first, batch) if runs and self.plan.shares_inputs else nullcontext()
        with thread_hooks(points), shared:
            return model(
                residual,
                start_at_layer=layer,
                stop_at_layer=layer + 1,
                past_kv_cache=run_rows(self.prefix, copies, batch),
                attention_mask=mask,
            )


def _logits(
    model: HookedTransformer,
    corrupted: CorruptedRun,
    pos: int,
    residual: Float[torch.Tensor, "rows new_tokens d_model"],
    plan: Plan,
) -> torch.Tensor:
    """Logits of rows that ran positions `pos:` through every layer."""
    if plan.last_only and plan.partial:
        return model(residual[:, -1:], start_at_layer=model.cfg.n_layers)
    logits = model(residual, start_at_layer=model.cfg.n_layers)
    if plan.last_only:
        return logits[:, -1:]
    return with_positions_before(logits, corrupted.logits, pos)


def _single_position_logits(
    model: HookedTransformer,
    corrupted: CorruptedRun,
    pos: int,
    end: int,
    alone: Float[torch.Tensor, "rows span d_model"],
    plan: Plan,
) -> torch.Tensor:
    """Logits of rows patched in the last layer, which ran positions `pos:end`.

    Every other position keeps the corrupted run's logits. With `plan.last_only`,
    `alone` may hold the last of those positions alone.
    """
    runs = alone.shape[0] // corrupted.logits.shape[0]
    if plan.last_only:
        if end == corrupted.logits.shape[1]:
            return model(alone[:, -1:], start_at_layer=model.cfg.n_layers)
        return corrupted.logits[:, -1:].repeat(runs, 1, 1)
    logits = corrupted.logits.repeat(runs, 1, 1)
    logits[:, pos:end] = model(alone, start_at_layer=model.cfg.n_layers)
    return logits

"""The engine behind the patching sweeps: many patched runs per forward pass.

A patch at layer `l`, position `p` of a causal model changes nothing before layer `l`
and nothing before position `p`. So the patched runs of a sweep are grouped by `p`;
each group shares one frozen [`KeyValueCache`][safelens.KeyValueCache] of the corrupted
run cropped to its first `p` positions, and runs only positions `p:` through the model.
Within a group, runs enter the model at their own layer: the batch starts at the lowest
patched layer from the corrupted run's residual stream, and the runs patched at each
later layer join the batch there (a staggered forward). The logits of positions `< p`
are the corrupted run's, copied in before the metric sees them.

Caveat: the batch at the last layer holds every run of the chunk, so the memory
budget bounds the runs per chunk, not per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int
from tqdm import tqdm
from transformer_lens import HookedTransformer
from transformer_lens.hook_points import HookPoint

from ._cache import KeyValueCache
from ._errors import PatchingError
from ._patch_plan import Plan
from ._shared_attention import shared_prefix_attention

__all__ = ["CorruptedRun", "Patcher", "sweep"]

# The context level of the sweep's own temporary hooks, so removing them leaves the
# user's hooks on the same hook point in place.
_SWEEP_LEVEL = -1

# Patch an activation in place for `runs`, whose `batch` rows each start at `rows`.
# `patcher(tensor, runs, rows, batch, start)`: `tensor` holds positions `start:`.
Patcher = Callable[[torch.Tensor, list["Run"], list[int], int, int], None]

# Runs patched at positions `p0 … p0 + _SPAN - 1` share one chunk that starts at `p0`:
# fewer, larger forward passes, for a few positions recomputed per run.
_SPAN = 4
Metric = Callable[[Float[torch.Tensor, "rows pos d_vocab"]], torch.Tensor]


@dataclass
class CorruptedRun:
    """What the corrupted run leaves for every patched run to reuse."""

    cache: KeyValueCache
    residuals: list[Float[torch.Tensor, "batch pos d_model"]]
    logits: Float[torch.Tensor, "batch pos d_vocab"]
    activations: dict[str, torch.Tensor]

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
        with model.hooks(fwd_hooks=[(name, capture) for name in names]):
            logits = model(tokens, past_kv_cache=cache, attention_mask=torch.ones_like(tokens))
        cache.freeze()
        residuals = [captured[f"blocks.{layer}.hook_resid_pre"] for layer in range(n_layers)]
        return cls(cache, residuals, logits, captured)


@dataclass(frozen=True)
class Run:
    """One patched run: where it enters, and where its metric goes in the result."""

    layer: int
    pos: int
    slot: int
    index: tuple[int, ...]


def _rows_per_run_limit(model: HookedTransformer, length: int, max_bytes: int) -> int:
    cfg = model.cfg
    width = 2 * cfg.d_vocab + 8 * cfg.d_model + 2 * (cfg.d_mlp or 0) + 3 * cfg.n_heads * length
    itemsize = torch.empty((), dtype=cfg.dtype).element_size()
    return max(1, max_bytes // (length * width * itemsize))


class _Metric:
    """A batched metric, or a per-run (TransformerLens-style scalar) one detected at first use."""

    def __init__(self, fn: Metric, batch: int) -> None:
        self.fn = fn
        self.batch = batch
        self.per_run: bool | None = None

    def __call__(self, logits: torch.Tensor, runs: int) -> torch.Tensor:
        if not self.per_run:
            values = torch.as_tensor(self.fn(logits))
            if self.per_run is None:
                if values.dim() == 0 and runs > 1:
                    self.per_run = True
                    return self(logits, runs)
                self.per_run = False
            if values.numel() != runs:
                raise PatchingError(
                    f"patching_metric returned shape {tuple(values.shape)} for logits "
                    f"{tuple(logits.shape)} of {runs} patched runs; expected [{runs}] (a "
                    "batched metric, one value per run) or a scalar per run "
                    "(TransformerLens-style)"
                )
            return values.reshape(runs)
        rows = logits.split(self.batch)
        return torch.stack([torch.as_tensor(self.fn(row)).reshape(()) for row in rows])


def sweep(
    model: HookedTransformer,
    corrupted: CorruptedRun,
    runs: list[Run],
    hook_name: Callable[[int], str],
    patcher: Patcher,
    metric: Metric,
    out: torch.Tensor,
    max_batch: int | None,
    max_bytes: int,
    progress: bool,
    single_position: bool,
) -> torch.Tensor:
    """Fill `out.view(-1)[run.slot]` with the metric of every patched run; return `out`.

    `single_position`: each run's patch changes its own position `run.pos` alone (a
    by-position sweep), which lets some sites skip work (see `safelens._patch_plan`).
    """
    batch, length = corrupted.logits.shape[:2]
    limit = _rows_per_run_limit(model, length, max_bytes) // batch
    runs_per_chunk = max(1, min(limit, max_batch) if max_batch else limit)
    scored = _Metric(metric, batch)
    last = model.cfg.n_layers - 1
    plan = Plan.of(model, hook_name(last).removeprefix(f"blocks.{last}."), single_position, metric)
    patch = _Patch(hook_name, patcher)
    flat = out.view(-1)
    by_pos: dict[int, list[Run]] = {}
    for run in runs:
        by_pos.setdefault(run.pos - run.pos % _SPAN, []).append(run)
    with (
        torch.no_grad(),
        shared_prefix_attention(model),
        tqdm(total=len(runs), disable=not progress, desc="patching") as bar,
    ):
        for pos, group in sorted(by_pos.items()):
            group.sort(key=lambda run: run.layer)
            for start in range(0, len(group), runs_per_chunk):
                chunk = group[start : start + runs_per_chunk]
                logits = _forward_chunk(model, corrupted, pos, chunk, patch, plan)
                slots = torch.tensor([run.slot for run in chunk], device=out.device)
                flat[slots] = scored(logits, len(chunk)).to(out.device, out.dtype)
                bar.update(len(chunk))
    return out


def _forward_chunk(
    model: HookedTransformer,
    corrupted: CorruptedRun,
    pos: int,
    chunk: list[Run],
    patch: _Patch,
    plan: Plan,
) -> Float[torch.Tensor, "rows pos d_vocab"]:
    """The logits of the chunk's runs (all patched at `pos` or later), `batch` rows per run.

    Positions `pos:` run through the model. Rows are in chunk order (the chunk is sorted
    by layer). With `plan.last_only` the logits are the last position's alone,
    `[rows, 1, d_vocab]`.
    """
    batch = corrupted.logits.shape[0]
    last = model.cfg.n_layers - 1
    layers = _Layers(model, corrupted.cache.crop(pos), batch, plan, pos)
    end = max(run.pos for run in chunk) + 1
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
        self, model: HookedTransformer, prefix: KeyValueCache, batch: int, plan: Plan, start: int
    ) -> None:
        self.model = model
        self.prefix = prefix
        self.batch = batch
        self.plan = plan
        self.start = start

    def run(
        self, residual: torch.Tensor, layer: int, patch: _Patch, runs: list[Run], first: int
    ) -> torch.Tensor:
        """`residual` through `layer`, patching `runs` (their rows from `first`), if any."""
        model, batch = self.model, self.batch
        points: list[tuple[HookPoint, Any]] = []
        if runs:
            rows = list(range(first, first + len(runs) * batch, batch))

            def hook(tensor: torch.Tensor, hook: object) -> torch.Tensor:
                patch.patcher(tensor, runs, rows, batch, self.start)
                return tensor

            # Attach to the one hook point directly: model.hooks() would sweep every
            # hook point of the model on exit, once per layer of every chunk.
            points.append((model.hook_dict[patch.hook_name(layer)], hook))
        if layer == model.cfg.n_layers - 1:
            points += [(model.hook_dict[name], fn) for name, fn in self.plan.last_layer_trims]
        for point, fn in points:
            point.add_hook(fn, level=_SWEEP_LEVEL)
        cache = _rows_of(self.prefix, residual.shape[0] // batch, batch)
        try:
            return model(
                residual, start_at_layer=layer, stop_at_layer=layer + 1, past_kv_cache=cache
            )
        finally:
            for point, _ in points:
                point.remove_hooks(level=_SWEEP_LEVEL)


def _logits(
    model: HookedTransformer,
    corrupted: CorruptedRun,
    pos: int,
    residual: Float[torch.Tensor, "rows new_tokens d_model"],
    plan: Plan,
) -> torch.Tensor:
    """Logits of rows that ran positions `pos:` through every layer."""
    if plan.last_only:
        return model(residual[:, -1:], start_at_layer=model.cfg.n_layers)
    logits = model(residual, start_at_layer=model.cfg.n_layers)
    if pos:
        runs = logits.shape[0] // corrupted.logits.shape[0]
        logits = torch.cat([corrupted.logits[:, :pos].repeat(runs, 1, 1), logits], dim=1)
    return logits


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


def _rows_of(prefix: KeyValueCache, runs: int, batch: int) -> KeyValueCache:
    """`prefix` repeated for `runs` runs (run-major rows), frozen: nothing is stored."""
    if batch == 1:
        rows = prefix.expand(runs)
    else:
        rows = prefix.select(torch.arange(batch).repeat(runs))
    rows.freeze()
    return rows

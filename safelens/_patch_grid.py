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

import torch
from jaxtyping import Float, Int
from tqdm import tqdm
from transformer_lens import HookedTransformer

from ._cache import KeyValueCache
from ._errors import PatchingError

__all__ = ["CorruptedRun", "Patcher", "sweep"]

# The context level of the sweep's own temporary hooks, so removing them leaves the
# user's hooks on the same hook point in place.
_SWEEP_LEVEL = -1

# Patch an activation in place for `runs`, whose `batch` rows each start at `rows`.
Patcher = Callable[[torch.Tensor, list["Run"], list[int], int], None]
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
) -> torch.Tensor:
    """Fill `out.view(-1)[run.slot]` with the metric of every patched run; return `out`."""
    batch, length = corrupted.logits.shape[:2]
    limit = _rows_per_run_limit(model, length, max_bytes) // batch
    runs_per_chunk = max(1, min(limit, max_batch) if max_batch else limit)
    scored = _Metric(metric, batch)
    flat = out.view(-1)
    by_pos: dict[int, list[Run]] = {}
    for run in runs:
        by_pos.setdefault(run.pos, []).append(run)
    with torch.no_grad(), tqdm(total=len(runs), disable=not progress, desc="patching") as bar:
        for pos, group in sorted(by_pos.items()):
            group.sort(key=lambda run: run.layer)
            for start in range(0, len(group), runs_per_chunk):
                chunk = group[start : start + runs_per_chunk]
                logits = _forward_chunk(model, corrupted, pos, chunk, hook_name, patcher)
                slots = torch.tensor([run.slot for run in chunk], device=out.device)
                flat[slots] = scored(logits, len(chunk)).to(out.device, out.dtype)
                bar.update(len(chunk))
    return out


def _forward_chunk(
    model: HookedTransformer,
    corrupted: CorruptedRun,
    pos: int,
    chunk: list[Run],
    hook_name: Callable[[int], str],
    patcher: Patcher,
) -> Float[torch.Tensor, "rows pos d_vocab"]:
    """The logits of the chunk's runs (all at position `pos`), `batch` rows per run."""
    batch = corrupted.logits.shape[0]
    prefix = corrupted.cache.crop(pos)
    residual: torch.Tensor | None = None
    n_layers = model.cfg.n_layers
    for layer in range(chunk[0].layer, n_layers):
        entering = [i for i, run in enumerate(chunk) if run.layer == layer]
        point = None
        if entering:
            new = corrupted.residuals[layer][:, pos:].repeat(len(entering), 1, 1)
            first = 0 if residual is None else residual.shape[0]
            residual = new if residual is None else torch.cat([residual, new])
            rows = list(range(first, residual.shape[0], batch))
            patched = [chunk[i] for i in entering]

            def hook(
                tensor: torch.Tensor,
                hook: object,
                patched: list[Run] = patched,
                rows: list[int] = rows,
            ) -> torch.Tensor:
                patcher(tensor, patched, rows, batch)
                return tensor

            # Attach to the one hook point directly: model.hooks() would sweep every
            # hook point of the model on exit, once per layer of every chunk.
            point = model.hook_dict[hook_name(layer)]
            point.add_hook(hook, level=_SWEEP_LEVEL)
        assert residual is not None
        cache = _rows_of(prefix, residual.shape[0] // batch, batch)
        try:
            residual = model(
                residual, start_at_layer=layer, stop_at_layer=layer + 1, past_kv_cache=cache
            )
        finally:
            if point is not None:
                point.remove_hooks(level=_SWEEP_LEVEL)
    logits = model(residual, start_at_layer=n_layers)
    if pos:
        before = corrupted.logits[:, :pos].repeat(len(chunk), 1, 1)
        logits = torch.cat([before, logits], dim=1)
    return logits


def _rows_of(prefix: KeyValueCache, runs: int, batch: int) -> KeyValueCache:
    """`prefix` repeated for `runs` runs (run-major rows), frozen: nothing is stored."""
    if batch == 1:
        rows = prefix.expand(runs)
    else:
        rows = prefix.select(torch.arange(batch).repeat(runs))
    rows.freeze()
    return rows

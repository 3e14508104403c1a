"""One chunk of prompt pairs through a sweep: `patched_chunk`, its size and clean cache.

`patch_dataset` (and its Ray form) takes pairs in chunks: `pairs_per_chunk` fits a
chunk's clean caches and logits in the memory budget (`pair_bytes`, an estimate),
`clean_cache_of` runs the chunk's clean prompts as the sweeps read them on the model's
family, and `patched_chunk` runs the sweep once with the chunk's pairs as its batch,
keeping one value per pair and cell.

How the per-pair values find their grid cell without touching the sweep: the metric
the sweep sees returns, per patched run, a unique run number; the sweep writes those
numbers into its result grid exactly where it writes metric values, so the grid it
returns is a map from cell to run, and each run's per-pair values are gathered through
it (cells a bundle pads with zeros, such as a grouped-query model's k and v rows in
`*_every`, stay 0). Nothing is copied to the host per patch.

Caveat: the run numbers are float32 in the sweep's grid, exact below 2**24 runs per
chunk of pairs (a grid of 16 million cells); larger grids are refused. The chunk size
comes from an estimate of a pair's clean cache and logits (every hook point of a
TransformerLens cache, with an MLP 4 `d_model` wide; the five patched activations on a
HuggingFace model), not a measurement.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float, Int

from ..backends._backend import Backend, NamesFilter
from ..core._errors import PatchingError
from ._hf_sites import run_with_patching_cache
from ._metric import reads_last_position

__all__ = [
    "PairMetric",
    "clean_cache_of",
    "lone_pair_doubled",
    "pair_bytes",
    "pairs_per_chunk",
    "patched_chunk",
]

PairMetric = Callable[
    [Float[torch.Tensor, "rows pos d_vocab"], Int[torch.Tensor, " rows"]],
    Float[torch.Tensor, " rows"],
]
_EXACT_FLOAT32 = 2**24


class _RunNumbers:
    """The metric the sweep sees: keeps per-pair values, returns each run's number."""

    def __init__(self, metric: PairMetric, pairs: torch.Tensor, first: int) -> None:
        self.metric = metric
        self.pairs = pairs
        self.next = first
        self.values: list[torch.Tensor] = []
        self.last_position_only = reads_last_position(metric)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        batch = self.pairs.numel()
        runs = logits.shape[0] // batch
        values = self.metric(logits, self.pairs.repeat(runs))
        if not isinstance(values, torch.Tensor) or values.numel() != runs * batch:
            got = (
                f"shape {tuple(values.shape)}"
                if isinstance(values, torch.Tensor)
                else type(values).__name__
            )
            raise PatchingError(
                f"metric returned {got} for logits {tuple(logits.shape)}; expected one value "
                f"per row, [{runs * batch}]: patch_dataset's metric scores each row (a pair "
                "under one patch) on its own, metric(logits, pairs) -> [rows]"
            )
        self.values.append(values.reshape(runs, batch).float())
        numbers = torch.arange(self.next, self.next + runs, device=logits.device)
        self.next += runs
        return numbers.float()


def _needed(sweep: Callable[..., torch.Tensor]) -> Callable[[str], bool]:
    """The clean cache names a HuggingFace `sweep` may read: patterns and scores (computed
    eagerly, `[batch, n_heads, pos, pos]` per layer) only for a sweep that patches patterns."""
    name = getattr(sweep, "__name__", "")
    patterns = "pattern" in name or (
        name.startswith("get_act_patch_attn_head_") and "every" in name
    )
    return lambda hook: patterns or not hook.endswith(("hook_pattern", "hook_attn_scores"))


def pair_bytes(backend: Backend, length: int) -> int:
    """Bytes one pair's clean cache and clean logits take, about."""
    if backend.family == "hf":  # run_with_patching_cache: residuals, module outputs, q, z, k, v
        width = 7 * backend.d_model + 2 * backend.n_kv_heads * backend.d_head
    else:  # every hook point, an MLP 4 * d_model wide, attention scores and pattern
        heads = max(1, backend.d_model // backend.d_head)
        width = 20 * backend.d_model + 2 * heads * length
    itemsize = torch.empty((), dtype=backend.dtype).element_size()
    return length * (backend.n_layers * width + backend.d_vocab) * itemsize


def pairs_per_chunk(backend: Backend, pairs: int, length: int, max_bytes: int) -> int:
    """How many pairs of `length` tokens one chunk takes within `max_bytes`."""
    return max(1, min(pairs, max_bytes // pair_bytes(backend, length)))


def clean_cache_of(
    backend: Backend, clean: torch.Tensor, names_filter: NamesFilter | None = None
) -> Any:
    """The clean cache the sweeps read on `backend`'s family, for the prompts `clean`.

    `names_filter`: keep only the activations it names (default: every one).
    """
    with torch.no_grad():
        if backend.family == "hf":
            return run_with_patching_cache(backend.model, clean, names_filter=names_filter)[1]
        return backend.model.run_with_cache(clean, names_filter=names_filter)[1]


def lone_pair_doubled(
    backend: Backend, clean: torch.Tensor, corrupted: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A lone pair twice on a HuggingFace model with a pad token, else as it is.

    Such a model masks left padding in batches of several prompts only
    (`default_mask`): a lone pair runs twice, as it would among others.
    """
    pad = getattr(backend.tokenizer, "pad_token_id", None)
    if backend.family == "hf" and pad is not None and clean.shape[0] == 1:
        return clean.repeat(2, 1), corrupted.repeat(2, 1)
    return clean, corrupted


def patched_chunk(
    sweep: Callable[..., torch.Tensor],
    backend: Backend,
    clean: torch.Tensor,
    corrupted: torch.Tensor,
    metric: PairMetric,
    rows: torch.Tensor,
    max_batch: int | None,
    max_bytes: int,
) -> Float[torch.Tensor, "pairs ..."]:
    """Per-pair values `[len(rows), *grid]` of the sweep over one chunk of pairs."""
    clean, corrupted = lone_pair_doubled(backend, clean, corrupted)
    batch = clean.shape[0]
    # Only a HuggingFace model's clean cache is trimmed: a bridge warns on a filter that
    # passes its gated-off hook names.
    clean_cache = clean_cache_of(backend, clean, _needed(sweep) if backend.family == "hf" else None)
    with torch.no_grad():
        numbered = _RunNumbers(metric, rows.repeat(batch // rows.numel()), 1)
        grid = sweep(
            backend.model,
            corrupted,
            clean_cache,
            numbered,
            max_batch=max_batch,
            max_bytes=max_bytes,
            progress=False,
        )
    if numbered.next >= _EXACT_FLOAT32:
        raise PatchingError(
            f"the sweep ran {numbered.next - 1} patched runs for one chunk of pairs; "
            f"patch_dataset numbers runs exactly up to {_EXACT_FLOAT32 - 1}. Patch a "
            "smaller grid: shorter prompts, or generic_activation_patch with an index_df "
            "on a HookedTransformer"
        )
    values = torch.cat([torch.zeros(1, batch, device=grid.device)] + numbered.values)
    return values[grid.long()].movedim(-1, 0)[: rows.numel()]

"""What an ablation edits, checked and resolved against a prefix: `Ablation`.

An [`Ablation`][safelens.Ablation] names what to edit (layers, KV heads, positions of
the prefix, keys and/or values) and how: `"zero"`, `"mean"` (over a reference set of
caches), `"resample"` (from another prompt's cache) or `"function"` (a function of the
selected slice). Its indices and references are checked when it is made. `_plan`
resolves a list of ablations against one prefix into `_Edit`s: index tensors in range
of the prefix, and, for `"mean"` and `"resample"`, the reference slices each edited
layer takes, every reference checked to fit the prefix. The read-time and write-time
ablations (`safelens.experiments._ablation`) apply those edits; nothing is edited before every
ablation of a call has been resolved.

Positions index the prefix's cache axis, left padding included. Heads index the
cache's heads axis: KV heads under grouped-query attention (an edit of KV head `h`
reaches every query head reading it), all `n_heads` with TransformerLens'
`ungroup_grouped_query_attention=True`. Both are axes of the backend's cache layout
(`safelens.backends._cache_ops.CacheLayout`): position-major `[batch, pos, n_kv_heads,
d_head]` pre-rotary keys in a `KeyValueCache`, head-major `[batch, n_kv_heads, pos,
d_head]` post-rotary keys in an `HFKeyValueCache`; a `"function"` ablation's `fn` gets
its slice in that layout.

Caveat: a `"mean"` weights every reference row by its attention mask at each position,
so a position that is padding in every reference row has no mean and is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from jaxtyping import Int

from ..backends._cache_ops import CacheLayout, CacheOps, CacheShape, cache_ops
from ..core._arguments import indices
from ..core._errors import CacheShapeError
from ..core._repr import summary_repr
from ._prefix import Prefix

__all__ = ["Ablation"]

AblationKind = Literal["zero", "mean", "resample", "function"]
AblationTarget = Literal["keys", "values", "both"]
Indices = int | Sequence[int] | None
_KINDS = ("zero", "mean", "resample", "function")
_TARGETS = ("keys", "values", "both")


def _index_spec(value: Any, what: str) -> int | tuple[int, ...] | None:
    """`value` checked and normalised: `None`, an int, or a tuple of distinct ints."""
    if value is None:
        return None
    ints = indices(value, what)
    if isinstance(ints, int):
        return ints
    if not ints:
        raise ValueError(f"{what} is empty, so the ablation would edit nothing; pass None for all")
    if len(set(ints)) != len(ints):
        raise ValueError(f"{what} {list(ints)} lists an index more than once; list each once")
    return ints


def _resolve(spec: Indices, size: int, what: str, of: str) -> torch.Tensor:
    """The indices `spec` selects among `size` (negative ones counted from the end)."""
    if spec is None:
        return torch.arange(size)
    listed = [spec] if isinstance(spec, int) else list(spec)
    bad = [i for i in listed if not -size <= i < size]
    if bad:
        raise IndexError(f"{what} {bad} out of range for {of}: each must be in [{-size}, {size})")
    normalised = [i % size for i in listed]
    if len(set(normalised)) != len(normalised):
        raise ValueError(f"{what} {listed} name one index twice (as i and i - {size})")
    return torch.tensor(normalised)


def _reference_list(ablation: Ablation) -> tuple[Any, ...]:
    """The reference caches/prefixes of a mean/resample ablation, checked for type."""
    given = ablation.reference
    refs = tuple(given) if isinstance(given, list | tuple) else (given,)
    if not refs:
        raise ValueError(f'kind="{ablation.kind}" needs at least one reference; got an empty list')
    if ablation.kind == "resample" and len(refs) != 1:
        raise ValueError(f'kind="resample" takes one reference cache or prefix, got {len(refs)}')
    for i, ref in enumerate(refs):
        if not isinstance(ref, Prefix) and not _is_cache(ref):
            raise TypeError(
                f"reference[{i}] must be a KeyValueCache or a Prefix (an HFKeyValueCache on "
                f"HuggingFace models), got {type(ref).__name__}"
            )
    return refs


def _is_cache(value: Any) -> bool:
    try:
        cache_ops(value)
    except TypeError:
        return False
    return True


@dataclass(frozen=True, repr=False)
class Ablation:
    """What to ablate in a prefix's keys/values, and with what.

    **Arguments:**

    - `kind`: `"zero"`, `"mean"`, `"resample"` or `"function"`.
    - `layers`: a layer or layers to edit; `None` for all.
    - `heads`: heads of the cache to edit (KV heads); `None` for all.
    - `positions`: prefix positions to edit (cache axis, padding included); `None` for all.
    - `target`: `"keys"`, `"values"` or `"both"`.
    - `reference`: for `"mean"`, the caches (or prefixes) to average over, every row
      weighted by its attention mask at each position; for `"resample"`, the cache (or
      prefix) to copy from, batch 1 or the prefix's batch. Either must come from the same
      model (layers, KV heads, `d_head`) and cover the edited positions.
    - `fn`: for `"function"`, called as `fn(slice, layer, target)` with the selected
      slice in the cache's layout, `[batch, positions, heads, d_head]` on a
      `HookedTransformer`, `[batch, heads, positions, d_head]` on a HuggingFace model
      (`target` is `"keys"` or `"values"`), returning a finite floating tensor of that
      shape.

    Indices are ints (negative ones count from the end), each listed once; bools,
    floats, strings and empty lists are refused. Lists are kept as tuples.

    **Raises:** `ValueError` for an unknown kind or target, a missing or superfluous
    `reference=`/`fn=`, or an empty or repeating index list; `TypeError` for indices
    that are not ints or references that are not caches or prefixes.

    ```python
    >>> Ablation("zero", layers=1, heads=[0], positions=[2, 3]).positions
    (2, 3)

    ```
    """

    __repr__ = summary_repr  # a reference tensor by its shape, not by value

    kind: AblationKind
    layers: Indices
    heads: Indices = None
    positions: Indices = None
    target: AblationTarget = "both"
    reference: Any = None
    fn: Callable[[torch.Tensor, int, str], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"kind must be one of {_KINDS}, got {self.kind!r}")
        if self.target not in _TARGETS:
            raise ValueError(f"target must be one of {_TARGETS}, got {self.target!r}")
        for name in ("layers", "heads", "positions"):
            object.__setattr__(self, name, _index_spec(getattr(self, name), name))
        uses_reference = self.kind in ("mean", "resample")
        if uses_reference and self.reference is None:
            raise ValueError(f'kind="{self.kind}" needs reference= (a cache or prefix)')
        if not uses_reference and self.reference is not None:
            raise ValueError(f'reference= is used by kind="mean" or "resample", not "{self.kind}"')
        if uses_reference:
            _reference_list(self)
        if self.kind == "function" and not callable(self.fn):
            raise ValueError('kind="function" needs fn=, called as fn(slice, layer, target)')
        if self.kind != "function" and self.fn is not None:
            raise ValueError(f'fn= is used by kind="function", not "{self.kind}"')

    def layer_list(self, n_layers: int) -> list[int]:
        """The edited layers of a model of `n_layers` layers, sorted."""
        return sorted(_resolve(self.layers, n_layers, "layers", f"{n_layers} layers").tolist())

    def targets(self) -> tuple[str, ...]:
        """`("keys",)`, `("values",)` or both."""
        return ("keys", "values") if self.target == "both" else (self.target,)


def _position_major(tensor: torch.Tensor, layout: CacheLayout) -> torch.Tensor:
    """A view of `tensor` (in `layout`) as `[batch, pos, heads, d_head]`."""
    return tensor.movedim((layout.pos_axis, layout.heads_axis), (1, 2))


def _in_layout(tensor: torch.Tensor, layout: CacheLayout) -> torch.Tensor:
    """A view of position-major `tensor` in `layout`."""
    return tensor.movedim((1, 2), (layout.pos_axis, layout.heads_axis))


class _Edit(NamedTuple):
    """One ablation resolved against a prefix: indices and reference slices, checked.

    `sources` are position-major `[batch, positions, heads, d_head]`.
    """

    ablation: Ablation
    layers: list[int]
    heads: Int[torch.Tensor, " heads"]
    positions: Int[torch.Tensor, " positions"]
    sources: dict[tuple[int, str], torch.Tensor]
    layout: CacheLayout

    def apply(self, tensor: torch.Tensor, layer: int, target: str, start: int) -> torch.Tensor:
        """`tensor` (in `layout`, holding positions `start…`) with this edit, as a new tensor."""
        layout = self.layout
        view = _position_major(tensor, layout)
        rows, cols = (self.positions - start)[:, None], self.heads[None, :]
        selected = view[:, rows, cols]
        if self.ablation.kind == "zero":
            new = torch.zeros_like(selected)
        elif self.ablation.kind == "function":
            given = _in_layout(selected, layout)
            new = _position_major(_checked(self.ablation.fn, given, layer, target, layout), layout)
        else:
            new = self.sources[layer, target].to(selected)
        out = view.clone()
        out[:, rows, cols] = new.expand(selected.shape)
        return _in_layout(out, layout)


def _checked(
    fn: Any, selected: torch.Tensor, layer: int, target: str, layout: CacheLayout
) -> torch.Tensor:
    result = fn(selected, layer, target)
    where = f"fn returned {{}} for layer {layer} {target}; expected"
    if not isinstance(result, torch.Tensor) or result.shape != selected.shape:
        got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
        named = layout.shape_names().replace("pos", "positions").replace("n_kv_heads", "heads")
        raise CacheShapeError(
            f"{where.format(got)} shape {tuple(selected.shape)} {named}, the slice it was given"
        )
    if not result.is_floating_point():
        raise CacheShapeError(
            f"{where.format(result.dtype)} a floating tensor like the slice ({selected.dtype})"
        )
    if not bool(torch.isfinite(result).all()):
        bad = int((~torch.isfinite(result)).sum())
        raise CacheShapeError(
            f"{where.format(f'{bad} NaN or infinite values')} finite keys/values; a NaN "
            "would reach every later position through attention"
        )
    return result.to(selected)


def _fitted(
    ref: Any, what: str, kind: str, ops: CacheOps, shape: CacheShape, last: int
) -> tuple[Any, Any]:
    """`(cache, mask)` of one reference, or a `CacheShapeError` saying what does not fit."""
    cache = ref.cache if isinstance(ref, Prefix) else ref
    if cache_ops(cache, what) is not ops:
        raise CacheShapeError(
            f"{what} is a {type(cache).__name__}, the prefix's cache a "
            f"{ops.cache_class_name}; a reference must come from the same model"
        )
    got = ops.shape(cache, what)
    wrong = [
        f"{name}: prefix has {want}, {what} {have}"
        for name, want, have in [
            ("layers", shape.n_layers, got.n_layers),
            ("n_kv_heads", shape.n_kv_heads, got.n_kv_heads),
            ("d_head", shape.d_head, got.d_head),
        ]
        if want != have
    ]
    if kind == "resample" and got.batch not in (1, shape.batch):
        wrong.append(f"batch: prefix has {shape.batch}, {what} {got.batch} (expected 1 or that)")
    if got.length <= last:
        wrong.append(f"pos: the ablation edits position {last}, {what} has {got.length}")
    if wrong:
        raise CacheShapeError(
            f"{what} does not fit the prefix: {'; '.join(wrong)}. A reference must come from "
            "the same model, cover the edited positions (use reference prompts at least as "
            "long) and, to resample, have batch 1 or the prefix's"
        )
    mask = ref.attention_mask if isinstance(ref, Prefix) else ops.stored_mask(cache)
    found = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
    if kind == "mean" and found != (got.batch, got.length):
        raise CacheShapeError(
            f"{what} needs an attention mask [batch={got.batch}, pos={got.length}] to weight "
            f"its rows in a mean, got {found}; pass a prefix, or a cache built with "
            "KeyValueCache(..., previous_attention_mask=)"
        )
    return cache, mask


def _sources(
    ablation: Ablation,
    ops: CacheOps,
    shape: CacheShape,
    layers: list[int],
    index: tuple[torch.Tensor, ...],
) -> dict[tuple[int, str], torch.Tensor]:
    """Each edited `(layer, target)`'s replacement slice from the references, checked."""
    heads, positions = index
    refs = _reference_list(ablation)
    listed = isinstance(ablation.reference, list | tuple)
    last = int(positions.max())
    fitted = [
        _fitted(ref, f"reference[{i}]" if listed else "reference", ablation.kind, ops, shape, last)
        for i, ref in enumerate(refs)
    ]
    weights: torch.Tensor | None = None
    if ablation.kind == "mean":
        device = ops.layer(fitted[0][0], 0)[0].device
        weights = torch.cat([mask[:, positions].to(device, torch.float32) for _, mask in fitted])
        empty = positions[(weights.sum(0) == 0).cpu()].tolist()
        if empty:
            raise CacheShapeError(
                f"every reference row is padding (attention mask 0) at positions {empty}, so "
                "the mean has nothing to average there; use references with real tokens there"
            )
    sources = {}
    for layer in layers:
        for target in ablation.targets():
            picked = [
                _position_major(ops.layer(cache, layer)[target == "values"], ops.layout)[
                    :, positions[:, None], heads[None, :]
                ]
                for cache, _ in fitted
            ]
            if weights is None:
                sources[layer, target] = picked[0]
                continue
            # On the layer's own device: a model split over devices keeps each layer apart.
            here = weights.to(picked[0].device)
            rows = torch.cat([p.to(here.device, torch.float32) for p in picked])
            mean = (rows * here[:, :, None, None]).sum(0, keepdim=True)
            sources[layer, target] = mean / here.sum(0)[None, :, None, None]
    return sources


def _plan(prefix: Prefix, ablations: Ablation | Sequence[Ablation], what: str) -> list[_Edit]:
    """Every ablation resolved against `prefix`, all checked before anything is edited."""
    if not isinstance(prefix, Prefix):
        raise TypeError(
            f"{what} needs a Prefix (from safelens.prefill), got {type(prefix).__name__}"
        )
    items = [ablations] if isinstance(ablations, Ablation) else list(ablations)
    if not items or not all(isinstance(a, Ablation) for a in items):
        raise TypeError("ablations must be an Ablation or a non-empty list of Ablation objects")
    prefix.check()
    ops = cache_ops(prefix.cache, "prefix.cache")
    shape = ops.shape(prefix.cache, "prefix.cache")
    edits = []
    for ablation in items:
        layers = ablation.layer_list(shape.n_layers)
        heads = _resolve(ablation.heads, shape.n_kv_heads, "heads", f"{shape.n_kv_heads} KV heads")
        positions = _resolve(
            ablation.positions, shape.length, "positions", f"a prefix of {shape.length} positions"
        )
        sources = {}
        if ablation.kind in ("mean", "resample"):
            sources = _sources(ablation, ops, shape, layers, (heads, positions))
        edits.append(_Edit(ablation, layers, heads, positions, sources, ops.layout))
    return edits

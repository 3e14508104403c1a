"""Ablating a prefix's keys and values: `Ablation`, `ablate_read`, `ablate_write`.

An [`Ablation`][safelens.Ablation] names what to edit (layers, KV heads, positions of
the prefix, keys and/or values) and how: `"zero"`, `"mean"` (over a reference set of
caches), `"resample"` (from another prompt's cache) or `"function"` (a function of the
selected slice). Two semantics apply it, each a function of its own:

- [`ablate_read`][safelens.ablate_read] (read-time): later tokens read the edited
  prefix keys/values; the prefix's own activations, and so its last logits, stay as
  computed. Cheap: no forward pass.
- [`ablate_write`][safelens.ablate_write] (write-time): the prefix is recomputed with the
  edit applied at `blocks.{l}.attn.hook_k` / `hook_v`, so later layers and positions of
  the prefix feel it. Only what the edit can change is recomputed: positions before the
  first edited position are reused, and (with the prefix's kept residuals) so are layers
  before the first edited layer.

Both return a new [`Prefix`][safelens.Prefix]; the source prefix and every reference are
never changed, and everything (indices, references, the model) is checked before
anything runs. Positions index the prefix's cache axis, left padding included. Heads
index the cache's heads axis: KV heads under grouped-query attention (an edit of KV head
`h` reaches every query head reading it), all `n_heads` with TransformerLens'
`ungroup_grouped_query_attention=True`.

Caveat: on models that normalise or clip keys after `attn.hook_k` (`use_qk_norm`, the
OLMo family's q/k norm, `clip_qkv`), the cache stores the normalised/clipped keys, so a
read-time edit and a write-time edit act on different tensors (see the docs page on
edits).
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from jaxtyping import Int

from ._cache import KeyValueCache
from ._config import refuse_ungrouped
from ._errors import CacheConfigError, CacheShapeError
from ._prefix import Prefix
from ._tokens import check_tokens

__all__ = ["Ablation", "ablate_read", "ablate_write"]

AblationKind = Literal["zero", "mean", "resample", "function"]
AblationTarget = Literal["keys", "values", "both"]
Indices = int | Sequence[int] | None
_KINDS = ("zero", "mean", "resample", "function")
_TARGETS = ("keys", "values", "both")
_NORMED_KEYS = ("OlmoeForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM")


def _as_int(value: Any) -> int | None:
    """`value` as an int if it is one (numpy and 0-d integer tensors too), else `None`."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _index_spec(value: Any, what: str) -> int | tuple[int, ...] | None:
    """`value` checked and normalised: `None`, an int, or a tuple of distinct ints."""
    if value is None:
        return None
    single = _as_int(value)
    if single is not None:
        return single
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise TypeError(
            f"{what} must be an int, a sequence of ints or None, got {type(value).__name__} "
            f"{value!r}"
        )
    items = list(value)
    if not items:
        raise ValueError(f"{what} is empty, so the ablation would edit nothing; pass None for all")
    picked = [_as_int(item) for item in items]
    for i, (item, index) in enumerate(zip(items, picked, strict=True)):
        if index is None:
            raise TypeError(
                f"{what} must hold ints, got {item!r} ({type(item).__name__}) at index {i}"
            )
    ints = tuple(index for index in picked if index is not None)
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
        if not isinstance(ref, KeyValueCache | Prefix):
            raise TypeError(
                f"reference[{i}] must be a KeyValueCache or a Prefix, got {type(ref).__name__}"
            )
    return refs


@dataclass(frozen=True)
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
      `[batch, positions, heads, d_head]` slice (`target` is `"keys"` or `"values"`),
      returning a finite floating tensor of that shape.

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


class _Shape(NamedTuple):
    layers: int
    batch: int
    length: int
    heads: int
    d_head: int


def _shape_of(cache: Any, what: str) -> _Shape:
    """The sizes of a cache of `[batch, pos, heads, d_head]` tensors, read without changing it."""
    if not isinstance(cache, KeyValueCache):
        raise TypeError(f"{what} must be a KeyValueCache, got {type(cache).__name__}")
    entries = cache.entries
    if not entries:
        raise CacheShapeError(
            f"{what} holds no layers (an empty KeyValueCache()); pass a prefix from "
            "prefill(model, tokens) or a cache a forward pass filled"
        )
    shapes = set()
    for entry in entries:
        for name in ("keys", "values"):
            tensor = getattr(entry, name)
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
                raise CacheShapeError(
                    f"{what} layer {entry.layer} {name} must be a [batch, pos, n_kv_heads, "
                    f"d_head] tensor, got {type(tensor).__name__} of shape "
                    f"{getattr(tensor, 'shape', None)}"
                )
            shapes.add(tuple(tensor.shape))
    if len(shapes) != 1:
        raise CacheShapeError(
            f"{what} holds keys/values of several shapes {sorted(shapes)}; every layer must "
            "be one [batch, pos, n_kv_heads, d_head] shape"
        )
    return _Shape(len(entries), *shapes.pop())


class _Edit(NamedTuple):
    """One ablation resolved against a prefix: indices and reference slices, checked."""

    ablation: Ablation
    layers: list[int]
    heads: Int[torch.Tensor, " heads"]
    positions: Int[torch.Tensor, " positions"]
    sources: dict[tuple[int, str], torch.Tensor]

    def apply(self, tensor: torch.Tensor, layer: int, target: str, start: int) -> torch.Tensor:
        """`tensor` (holding positions `start…`) with this edit, as a new tensor."""
        rows, cols = (self.positions - start)[:, None], self.heads[None, :]
        selected = tensor[:, rows, cols]
        if self.ablation.kind == "zero":
            new = torch.zeros_like(selected)
        elif self.ablation.kind == "function":
            new = _checked(self.ablation.fn, selected, layer, target)
        else:
            new = self.sources[layer, target].to(selected)
        out = tensor.clone()
        out[:, rows, cols] = new.expand(selected.shape)
        return out


def _checked(fn: Any, selected: torch.Tensor, layer: int, target: str) -> torch.Tensor:
    result = fn(selected, layer, target)
    where = f"fn returned {{}} for layer {layer} {target}; expected"
    if not isinstance(result, torch.Tensor) or result.shape != selected.shape:
        got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
        raise CacheShapeError(
            f"{where.format(got)} shape {tuple(selected.shape)} [batch, positions, heads, "
            "d_head], the slice it was given"
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


def _fitted(ref: Any, what: str, kind: str, shape: _Shape, last: int) -> tuple[Any, Any]:
    """`(cache, mask)` of one reference, or a `CacheShapeError` saying what does not fit."""
    cache = ref.cache if isinstance(ref, Prefix) else ref
    got = _shape_of(cache, what)
    wrong = [
        f"{name}: prefix has {want}, {what} {have}"
        for name, want, have in [
            ("layers", shape.layers, got.layers),
            ("n_kv_heads", shape.heads, got.heads),
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
    mask = ref.attention_mask if isinstance(ref, Prefix) else cache.previous_attention_mask
    found = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
    if kind == "mean" and found != (got.batch, got.length):
        raise CacheShapeError(
            f"{what} needs an attention mask [batch={got.batch}, pos={got.length}] to weight "
            f"its rows in a mean, got {found}; pass a prefix, or a cache built with "
            "KeyValueCache(..., previous_attention_mask=)"
        )
    return cache, mask


def _sources(
    ablation: Ablation, shape: _Shape, layers: list[int], index: tuple[torch.Tensor, ...]
) -> dict[tuple[int, str], torch.Tensor]:
    """Each edited `(layer, target)`'s replacement slice from the references, checked."""
    heads, positions = index
    refs = _reference_list(ablation)
    listed = isinstance(ablation.reference, list | tuple)
    last = int(positions.max())
    fitted = [
        _fitted(ref, f"reference[{i}]" if listed else "reference", ablation.kind, shape, last)
        for i, ref in enumerate(refs)
    ]
    weights: torch.Tensor | None = None
    if ablation.kind == "mean":
        device = fitted[0][0].entries[0].keys.device
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
                getattr(cache[layer], target)[:, positions[:, None], heads[None, :]]
                for cache, _ in fitted
            ]
            if weights is None:
                sources[layer, target] = picked[0]
                continue
            rows = torch.cat([p.to(weights.device, torch.float32) for p in picked])
            mean = (rows * weights[:, :, None, None]).sum(0, keepdim=True)
            sources[layer, target] = mean / weights.sum(0)[None, :, None, None]
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
    shape = _shape_of(prefix.cache, "prefix.cache")
    edits = []
    for ablation in items:
        layers = ablation.layer_list(shape.layers)
        heads = _resolve(ablation.heads, shape.heads, "heads", f"{shape.heads} KV heads")
        positions = _resolve(
            ablation.positions, shape.length, "positions", f"a prefix of {shape.length} positions"
        )
        sources = {}
        if ablation.kind in ("mean", "resample"):
            sources = _sources(ablation, shape, layers, (heads, positions))
        edits.append(_Edit(ablation, layers, heads, positions, sources))
    return edits


def ablate_read(prefix: Prefix, ablations: Ablation | Sequence[Ablation]) -> Prefix:
    """Read-time ablation: a prefix whose stored keys/values are edited, nothing rerun.

    Continuations of the result read the edited keys/values; the prefix's own
    activations (its last logits, residuals) stay as computed. Unedited layers share
    the source's storage; the source prefix and the references are unchanged. A
    `"function"` ablation's `fn` gets slices of the stored keys/values.

    **Arguments:**

    - `prefix`: a [`Prefix`][safelens.Prefix].
    - `ablations`: an [`Ablation`][safelens.Ablation] or a list, applied in order.

    **Returns:** a new, frozen [`Prefix`][safelens.Prefix].

    **Raises:** `IndexError` for a layer, head or position out of range (naming the
    bound); [`CacheShapeError`][safelens.CacheShapeError] for a reference that does not
    fit the prefix (saying which part) or an `fn` result that does not fit its slice.
    Nothing is edited then.

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> model = HookedTransformer(HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=32, d_head=8, d_vocab=20, act_fn="gelu"))
    >>> prefix = prefill(model, torch.tensor([[1, 2, 3, 4]]))
    >>> edited = ablate_read(prefix, Ablation("zero", layers=0, positions=[1]))
    >>> edited.cache[0].keys[0, 1].abs().sum().item(), prefix.cache[0].keys[0, 1].abs().sum().item() > 0
    (0.0, True)

    ```
    """
    edits = _plan(prefix, ablations, "ablate_read")
    cache = prefix.cache.fork()
    for edit in edits:
        for layer in edit.layers:
            entry = cache[layer]
            for target in edit.ablation.targets():
                setattr(entry, target, edit.apply(getattr(entry, target), layer, target, 0))
    cache.freeze()
    return Prefix(cache, prefix.tokens, prefix.attention_mask, prefix.last_logits, prefix.residuals)


def _check_model(model: Any, prefix: Prefix, edits: list[_Edit]) -> None:
    """Refuse a model the prefix was not run through, or an edit it cannot take at `hook_k`."""
    cfg = getattr(model, "cfg", None)
    if cfg is None or not hasattr(model, "hook_dict"):
        raise TypeError(
            f"ablate_write needs the HookedTransformer the prefix was run through, got "
            f"{type(model).__name__}"
        )
    refuse_ungrouped(cfg, "ablate_write")
    try:
        prefix.cache.check_fits(cfg)
    except CacheConfigError as error:
        raise CacheConfigError(f"ablate_write: model does not fit prefix.cache: {error}") from None
    check_tokens(prefix.tokens, cfg, "prefix.tokens")
    wrong = []
    if prefix.last_logits.shape[-1] != cfg.d_vocab_out:
        wrong.append(f"prefix.last_logits has d_vocab={prefix.last_logits.shape[-1]}")
    residuals = prefix.residuals or ()
    widths = {tuple(r.shape) for r in residuals}
    if residuals and (
        len(residuals) != cfg.n_layers or widths != {(*prefix.tokens.shape, cfg.d_model)}
    ):
        wrong.append(f"prefix.residuals are {len(residuals)} of shapes {sorted(widths)}")
    if wrong:
        raise CacheConfigError(
            f"ablate_write: model does not fit the prefix: {'; '.join(wrong)}, but the model "
            f"has d_vocab_out={cfg.d_vocab_out}, n_layers={cfg.n_layers}, d_model={cfg.d_model}."
            " Pass the model the prefix was run through"
        )
    normed = cfg.use_qk_norm or cfg.original_architecture in _NORMED_KEYS
    for edit in edits:
        if normed and edit.sources and "keys" in edit.ablation.targets():
            raise CacheConfigError(
                f'ablate_write: a kind="{edit.ablation.kind}" ablation of keys on a model that '
                "normalises keys after blocks.{l}.attn.hook_k (use_qk_norm, or the OLMo "
                "family's q/k norm) would normalise the reference's cached, already "
                "normalised keys a second time. Use ablate_read (it substitutes cached keys), "
                'target="values", or kind="function" with keys captured at '
                "blocks.{l}.attn.hook_k of the reference prompt"
            )


@contextmanager
def _attached(model: Any, hooks: list[tuple[str, Callable[..., Any]]]) -> Iterator[None]:
    """`hooks` on the model's hook points for this thread's passes in the block only.

    Plain torch hooks with their own handles, removed on exit (also on error), so
    neither hooks of other callers nor other threads' passes through the model are
    touched, and TransformerLens' shared `context_level` is left alone.
    """
    owner = threading.get_ident()
    handles = []

    def torch_hook(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(point: Any, args: Any, output: torch.Tensor) -> Any:
            return fn(output, point) if threading.get_ident() == owner else None

        return call

    try:
        for name, fn in hooks:
            handles.append(model.hook_dict[name].register_forward_hook(torch_hook(fn)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def ablate_write(model: Any, prefix: Prefix, ablations: Ablation | Sequence[Ablation]) -> Prefix:
    """Write-time ablation: the prefix recomputed with the edit in its keys/values.

    The edit is applied at `blocks.{l}.attn.hook_k` / `hook_v` (hooks attached for this
    thread's recomputation only, removed after it, also on error), so the result equals one
    TransformerLens `run_with_hooks` over the prefix with the same edit there, on every
    model. A `"function"` ablation's `fn` gets slices of those activations (before any
    q/k norm or `clip_qkv`); `"mean"` and `"resample"` write the references' cached
    keys/values there. Positions before the first edited one are reused from `prefix`;
    when `prefix` kept its residuals, layers before the first edited one are reused too.
    The source prefix and the references are unchanged.

    **Arguments:**

    - `model`: the `HookedTransformer` the prefix was run through.
    - `prefix`: a [`Prefix`][safelens.Prefix].
    - `ablations`: an [`Ablation`][safelens.Ablation] or a list, applied in order.

    **Returns:** a new, frozen [`Prefix`][safelens.Prefix] with the recomputed cache,
    last logits and residuals.

    **Raises:** as [`ablate_read`][safelens.ablate_read], before anything runs; also
    [`CacheConfigError`][safelens.CacheConfigError] for a model that does not fit the
    prefix (layers, KV heads, `d_head`, dtype, `d_model`, `d_vocab`) or a mean/resample
    of keys on a model that normalises keys after `attn.hook_k`, and
    [`TokenError`][safelens.TokenError] for prefix tokens the model cannot embed.

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> model = HookedTransformer(HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=32, d_head=8, d_vocab=20, act_fn="gelu"))
    >>> prefix = prefill(model, torch.tensor([[1, 2, 3, 4]]))
    >>> edited = ablate_write(model, prefix, Ablation("zero", layers=0, positions=[1]))
    >>> bool(torch.equal(edited.cache[1].keys[:, 2:], prefix.cache[1].keys[:, 2:]))
    False

    ```
    """
    edits = _plan(prefix, ablations, "ablate_write")
    _check_model(model, prefix, edits)
    n_layers = model.cfg.n_layers
    plan: dict[int, list[_Edit]] = {}
    for edit in edits:
        for layer in edit.layers:
            plan.setdefault(layer, []).append(edit)
    start = min(int(edit.positions.min()) for edit in edits)
    reuse_layers = (
        prefix.residuals is not None and model.cfg.positional_embedding_type != "shortformer"
    )
    skip = min(plan) if reuse_layers else 0
    cropped = prefix.cache.crop(start)
    full = prefix.cache.fork()
    # Layers before `skip` hold the whole prefix, later ones its first `start` positions:
    # a working cache the constructor would refuse, so it is assembled unchecked.
    cache = KeyValueCache.assembled(
        {i: full[i] if i < skip else cropped[i] for i in range(n_layers)},
        prefix.attention_mask if reuse_layers else cropped.previous_attention_mask,
    )

    def editor(layer: int, target: str) -> Callable[[torch.Tensor, Any], torch.Tensor]:
        def edit(tensor: torch.Tensor, hook: Any) -> torch.Tensor:
            for item in plan[layer]:
                if target in item.ablation.targets():
                    tensor = item.apply(tensor, layer, target, start)
            return tensor

        return edit

    hooks: list[tuple[str, Callable[[torch.Tensor, Any], Any]]] = [
        (f"blocks.{layer}.attn.hook_{target[0]}", editor(layer, target))
        for layer, items in plan.items()
        for target in ("keys", "values")
        if any(target in item.ablation.targets() for item in items)
    ]
    residuals: dict[int, torch.Tensor] = {}

    def keep(resid: torch.Tensor, hook: Any) -> None:
        residuals[hook.layer()] = resid

    if prefix.residuals is not None:
        hooks += [(f"blocks.{i}.hook_resid_pre", keep) for i in range(skip, n_layers)]
    with torch.no_grad(), _attached(model, hooks):
        if reuse_layers:
            assert prefix.residuals is not None
            logits = model(
                prefix.residuals[skip][:, start:],
                start_at_layer=skip,
                attention_mask=prefix.attention_mask,
                past_kv_cache=cache,
            )
        else:
            logits = model(
                prefix.tokens[:, start:],
                attention_mask=prefix.attention_mask[:, start:],
                past_kv_cache=cache,
            )
    cache.freeze()
    kept = None
    if prefix.residuals is not None:
        kept = tuple(
            prefix.residuals[i]
            if i < skip
            else torch.cat([prefix.residuals[i][:, :start], residuals[i]], dim=1)
            for i in range(n_layers)
        )
    return Prefix(cache, prefix.tokens, prefix.attention_mask, logits[:, -1], kept)

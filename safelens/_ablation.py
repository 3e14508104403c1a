"""Ablating a prefix's keys and values: `Ablation`, `ablate_read`, `ablate_write`.

An [`Ablation`][safelens.Ablation] names what to edit (layers, KV heads, positions of
the prefix, keys and/or values) and how: `"zero"`, `"mean"` (over a reference set of
caches), `"resample"` (from another prompt's cache) or `"function"` (a function of the
selected slice). Two semantics apply it, each a function of its own:

- [`ablate_read`][safelens.ablate_read] (read-time): later tokens read the edited
  prefix keys/values; the prefix's own activations, and so its last logits, stay as
  computed. Cheap: no forward pass.
- [`ablate_write`][safelens.ablate_write] (write-time): the prefix is recomputed with the
  edit written into its keys/values, so later layers and positions of the prefix feel
  it. Only what the edit can change is recomputed: positions before the first edited
  position are reused, and (with the prefix's kept residuals) so are layers before the
  first edited layer.

Both return a new [`Prefix`][safelens.Prefix]; the source prefix is never changed.
Positions index the prefix's cache axis, left padding included. Heads are KV heads
(for grouped-query attention, an edit of KV head `h` reaches every query head reading it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ._cache import KeyValueCache
from ._errors import CacheShapeError
from ._prefix import Prefix

__all__ = ["Ablation", "ablate_read", "ablate_write"]

AblationKind = Literal["zero", "mean", "resample", "function"]
AblationTarget = Literal["keys", "values", "both"]
_KINDS = ("zero", "mean", "resample", "function")
_TARGETS = ("keys", "values", "both")


def _indices(value: int | Sequence[int] | None, size: int, what: str) -> torch.Tensor:
    index = torch.arange(size)
    if value is None:
        return index
    try:
        picked = index[torch.as_tensor([value] if isinstance(value, int) else list(value))]
    except IndexError:
        raise IndexError(f"{what} {value!r} out of range: there are {size}") from None
    if picked.numel() == 0:
        raise ValueError(f"{what} {value!r} selects nothing")
    return picked


@dataclass(frozen=True)
class Ablation:
    """What to ablate in a prefix's keys/values, and with what.

    **Arguments:**

    - `kind`: `"zero"`, `"mean"`, `"resample"` or `"function"`.
    - `layers`: a layer or layers to edit.
    - `heads`: KV heads to edit; `None` for all.
    - `positions`: prefix positions to edit (cache axis, padding included); `None` for all.
    - `target`: `"keys"`, `"values"` or `"both"`.
    - `reference`: for `"mean"`, the caches (or prefixes) to average over, every row
      weighted by its attention mask at each position; for `"resample"`, the cache (or
      prefix) to copy from, batch 1 or the prefix's batch. Either must cover the edited
      positions.
    - `fn`: for `"function"`, called as `fn(slice, layer, target)` with the selected
      `[batch, positions, heads, d_head]` slice (`target` is `"keys"` or `"values"`),
      returning a tensor of that shape.

    ```python
    >>> Ablation("zero", layers=1, heads=[0], positions=[2, 3]).target
    'both'

    ```
    """

    kind: AblationKind
    layers: int | Sequence[int]
    heads: int | Sequence[int] | None = None
    positions: int | Sequence[int] | None = None
    target: AblationTarget = "both"
    reference: Any = None
    fn: Callable[[torch.Tensor, int, str], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"kind must be one of {_KINDS}, got {self.kind!r}")
        if self.target not in _TARGETS:
            raise ValueError(f"target must be one of {_TARGETS}, got {self.target!r}")
        if self.kind in ("mean", "resample") and self.reference is None:
            raise ValueError(f'kind="{self.kind}" needs reference= (a cache or prefix)')
        if self.kind == "function" and not callable(self.fn):
            raise ValueError('kind="function" needs fn=, called as fn(slice, layer, target)')

    def layer_list(self, n_layers: int) -> list[int]:
        """The edited layers, sorted."""
        return sorted(set(_indices(self.layers, n_layers, "layers").tolist()))

    def targets(self) -> tuple[str, ...]:
        """`("keys",)`, `("values",)` or both."""
        return ("keys", "values") if self.target == "both" else (self.target,)

    def replacement(
        self, original: torch.Tensor, layer: int, target: str, positions: torch.Tensor
    ) -> torch.Tensor:
        """The new `[batch, positions, heads, d_head]` slice at absolute `positions`."""
        heads = _indices(self.heads, original.shape[2], "heads")
        selected = original[:, positions[:, None], heads[None, :]]
        if self.kind == "zero":
            return torch.zeros_like(selected)
        if self.kind == "function":
            assert self.fn is not None
            result = self.fn(selected, layer, target)
            if not isinstance(result, torch.Tensor) or result.shape != selected.shape:
                raise CacheShapeError(
                    f"fn returned {getattr(result, 'shape', type(result).__name__)} for "
                    f"layer {layer} {target}; expected shape {tuple(selected.shape)} "
                    "[batch, positions, heads, d_head]"
                )
            return result.to(selected.dtype)
        return self._from_reference(layer, target, positions, heads).to(selected)

    def _from_reference(
        self, layer: int, target: str, positions: torch.Tensor, heads: torch.Tensor
    ) -> torch.Tensor:
        refs = self.reference if isinstance(self.reference, list | tuple) else [self.reference]
        if self.kind == "resample" and len(refs) != 1:
            raise ValueError('kind="resample" takes one reference cache or prefix')
        total: torch.Tensor | None = None
        weight: torch.Tensor | None = None
        for ref in refs:
            cache = ref.cache if isinstance(ref, Prefix) else ref
            if not isinstance(cache, KeyValueCache):
                raise TypeError(
                    f"reference must hold KeyValueCache or Prefix objects, got "
                    f"{type(cache).__name__}"
                )
            tensor = getattr(cache[layer], target)
            if tensor.shape[1] <= int(positions.max()):
                raise CacheShapeError(
                    f"reference cache has {tensor.shape[1]} positions; the ablation edits "
                    f"position {int(positions.max())}. Use reference prompts at least as long"
                )
            picked = tensor[:, positions[:, None], heads[None, :]]
            if self.kind == "resample":
                return picked
            mask = cache.previous_attention_mask
            rows = (
                torch.ones(picked.shape[:2], device=picked.device)
                if mask is None
                else mask[:, positions].to(picked.device, torch.float32)
            )
            summed = (picked.float() * rows[:, :, None, None]).sum(dim=0, keepdim=True)
            total = summed if total is None else total + summed
            counted = rows.sum(dim=0)[None, :, None, None]
            weight = counted if weight is None else weight + counted
        assert total is not None and weight is not None
        return total / weight.clamp(min=1)


def _as_list(ablations: Ablation | Sequence[Ablation]) -> list[Ablation]:
    items = [ablations] if isinstance(ablations, Ablation) else list(ablations)
    if not items or not all(isinstance(a, Ablation) for a in items):
        raise TypeError("ablations must be an Ablation or a non-empty list of Ablation objects")
    return items


def _edited(
    tensor: torch.Tensor,
    ablation: Ablation,
    layer: int,
    target: str,
    positions: torch.Tensor,
    start: int,
) -> torch.Tensor:
    """`tensor` (holding positions `start…`) with `ablation` applied at `positions`."""
    full = tensor
    if start:
        before = tensor.new_zeros((tensor.shape[0], start, *tensor.shape[2:]))
        full = torch.cat([before, tensor], dim=1)
    heads = _indices(ablation.heads, tensor.shape[2], "heads")
    new = ablation.replacement(full, layer, target, positions)
    where = ((positions - start)[:, None], heads[None, :])
    out = tensor.clone()
    out[:, where[0], where[1]] = new.expand(tensor.shape[0], *new.shape[1:])
    return out


def _check_prefix(prefix: Prefix, what: str) -> None:
    if not isinstance(prefix, Prefix):
        raise TypeError(
            f"{what} needs a Prefix (from safelens.prefill), got {type(prefix).__name__}"
        )


def ablate_read(prefix: Prefix, ablations: Ablation | Sequence[Ablation]) -> Prefix:
    """Read-time ablation: a prefix whose stored keys/values are edited, nothing rerun.

    Continuations of the result read the edited keys/values; the prefix's own
    activations (its last logits, residuals) stay as computed. Unedited layers share
    the source's storage; the source prefix is unchanged.

    **Arguments:**

    - `prefix`: a [`Prefix`][safelens.Prefix].
    - `ablations`: an [`Ablation`][safelens.Ablation] or a list, applied in order.

    **Returns:** a new, frozen [`Prefix`][safelens.Prefix].

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> model = HookedTransformer(HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=32, d_head=8, d_vocab=20, act_fn="gelu"))
    >>> prefix = prefill(model, torch.tensor([[1, 2, 3, 4]]))
    >>> edited = ablate_read(prefix, Ablation("zero", layers=0, positions=[1]))
    >>> edited.cache[0].keys[0, 1].abs().sum().item(), prefix.cache[0].keys[0, 1].abs().sum().item() > 0
    (0.0, True)

    ```
    """
    _check_prefix(prefix, "ablate_read")
    items = _as_list(ablations)
    cache = prefix.cache.fork()
    n_layers = len(cache)
    for ablation in items:
        positions = _indices(ablation.positions, prefix.length, "positions")
        for layer in ablation.layer_list(n_layers):
            entry = cache[layer]
            for target in ablation.targets():
                edited = _edited(getattr(entry, target), ablation, layer, target, positions, 0)
                setattr(entry, target, edited)
    cache.freeze()
    return Prefix(cache, prefix.tokens, prefix.attention_mask, prefix.last_logits, prefix.residuals)


def ablate_write(model: Any, prefix: Prefix, ablations: Ablation | Sequence[Ablation]) -> Prefix:
    """Write-time ablation: the prefix recomputed with the edit in its keys/values.

    Equals one TransformerLens `run_with_hooks` over the prefix with the same edit on
    `blocks.{l}.attn.hook_k` / `hook_v`. Positions before the first edited one are
    reused from `prefix`; when `prefix` kept its residuals, layers before the first
    edited one are reused too. The source prefix is unchanged.

    **Arguments:**

    - `model`: the `HookedTransformer` the prefix was run through.
    - `prefix`: a [`Prefix`][safelens.Prefix].
    - `ablations`: an [`Ablation`][safelens.Ablation] or a list, applied in order.

    **Returns:** a new, frozen [`Prefix`][safelens.Prefix] with the recomputed cache,
    last logits and residuals.

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> model = HookedTransformer(HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=32, d_head=8, d_vocab=20, act_fn="gelu"))
    >>> prefix = prefill(model, torch.tensor([[1, 2, 3, 4]]))
    >>> edited = ablate_write(model, prefix, Ablation("zero", layers=0, positions=[1]))
    >>> bool(torch.equal(edited.cache[1].keys[:, 2:], prefix.cache[1].keys[:, 2:]))
    False

    ```
    """
    _check_prefix(prefix, "ablate_write")
    items = _as_list(ablations)
    n_layers = model.cfg.n_layers
    plan: dict[int, list[tuple[Ablation, torch.Tensor]]] = {}
    for ablation in items:
        positions = _indices(ablation.positions, prefix.length, "positions")
        for layer in ablation.layer_list(n_layers):
            plan.setdefault(layer, []).append((ablation, positions))
    start = min(int(p.min()) for edits in plan.values() for _, p in edits)
    first_layer = min(plan)
    reuse_layers = (
        prefix.residuals is not None and model.cfg.positional_embedding_type != "shortformer"
    )
    skip = first_layer if reuse_layers else 0
    cropped = prefix.cache.crop(start)
    full = prefix.cache.fork()
    cache = KeyValueCache(
        [full[i] if i < skip else cropped[i] for i in range(n_layers)],
        previous_attention_mask=prefix.attention_mask
        if reuse_layers
        else cropped.previous_attention_mask,
    )

    def editor(layer: int, target: str) -> Callable[[torch.Tensor, Any], torch.Tensor]:
        def edit(tensor: torch.Tensor, hook: Any) -> torch.Tensor:
            for ablation, positions in plan[layer]:
                if target in ablation.targets():
                    tensor = _edited(tensor, ablation, layer, target, positions, start)
            return tensor

        return edit

    for layer in plan:
        cache[layer].hook_k_new.add_hook(editor(layer, "keys"))
        cache[layer].hook_v_new.add_hook(editor(layer, "values"))
    residuals: dict[int, torch.Tensor] = {}

    def keep(resid: torch.Tensor, hook: Any) -> None:
        residuals[hook.layer()] = resid

    hooks = [(f"blocks.{i}.hook_resid_pre", keep) for i in range(skip, n_layers)]
    tail = prefix.tokens[:, start:]
    try:
        with torch.no_grad(), model.hooks(fwd_hooks=hooks if prefix.residuals else []):
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
                    tail, attention_mask=prefix.attention_mask[:, start:], past_kv_cache=cache
                )
    finally:
        for layer in plan:
            cache[layer].hook_k_new.remove_hooks(including_permanent=True)
            cache[layer].hook_v_new.remove_hooks(including_permanent=True)
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

"""Ablating a prefix's keys and values: `ablate_read` and `ablate_write`.

An [`Ablation`][safelens.Ablation] (`safelens.experiments._ablation_plan`) names what to edit and
how. Two semantics apply it, each a function of its own:

- [`ablate_read`][safelens.ablate_read] (read-time): later tokens read the edited
  prefix keys/values; the prefix's own activations, and so its last logits, stay as
  computed. Cheap: no forward pass.
- [`ablate_write`][safelens.ablate_write] (write-time): the prefix is recomputed with the
  edit applied where the backend writes keys/values (its `write_hook`:
  `blocks.{l}.attn.hook_k` / `hook_v` on a `HookedTransformer`, the cache's
  `model.layers.{l}.kv_cache.hook_k_new` / `hook_v_new` on a HuggingFace model), so later
  layers and positions of the prefix feel it. Only what the edit can change is
  recomputed: positions before the first edited position are reused, and (with the
  prefix's kept residuals, on a `HookedTransformer`) so are layers before the first
  edited layer.

Both return a new [`Prefix`][safelens.Prefix]; the source prefix and every reference are
never changed, and everything (indices, references, the model) is checked before
anything runs.

Caveats: on `HookedTransformer` models that normalise or clip keys after `attn.hook_k`
(`use_qk_norm`, the OLMo family's q/k norm, `clip_qkv`), the cache stores the
normalised/clipped keys, so a read-time edit and a write-time edit act on different
tensors (see the docs page on edits). On HuggingFace models keys are edited after the
rotary embedding, so a key substituted from another position (`"mean"`, `"resample"`)
carries that position's rotation; positions of the references and the prefix agree
when neither is padded differently.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..backends._backend import Backend
from ..backends._cache_ops import cache_ops
from ..backends._families import backend_of
from ..backends._supported import SupportedModel
from ..core._errors import CacheConfigError
from ..core._thread_hooks import Hook
from ..core._tokens import check_tokens
from ._ablation_plan import Ablation, _Edit, _plan
from ._prefix import Prefix, token_limits

__all__ = ["ablate_read", "ablate_write"]

_NORMED_KEYS = ("OlmoeForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM")


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
    ops = cache_ops(prefix.cache)
    layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for edit in edits:
        for layer in edit.layers:
            keys, values = layers.get(layer) or ops.layer(prefix.cache, layer)
            if "keys" in edit.ablation.targets():
                keys = edit.apply(keys, layer, "keys", 0)
            if "values" in edit.ablation.targets():
                values = edit.apply(values, layer, "values", 0)
            layers[layer] = (keys, values)
    cache = ops.replaced(prefix.cache, layers)
    return Prefix(cache, prefix.tokens, prefix.attention_mask, prefix.last_logits, prefix.residuals)


def _backend(model: Any, prefix: Prefix, edits: list[_Edit]) -> Backend:
    """The model's backend; refuse a model the prefix was not run through, or an edit it cannot take."""
    try:
        backend = backend_of(model, "ablate_write")
    except TypeError:
        raise TypeError(
            f"ablate_write needs the HookedTransformer the prefix was run through (or the "
            f"HuggingFace model), got {type(model).__name__}"
        ) from None
    try:
        backend.check_cache(prefix.cache, "ablate_write")
    except CacheConfigError as error:
        raise CacheConfigError(f"ablate_write: model does not fit prefix.cache: {error}") from None
    check_tokens(prefix.tokens, token_limits(backend), "prefix.tokens")
    wrong = []
    if prefix.last_logits.shape[-1] != backend.d_vocab:
        wrong.append(f"prefix.last_logits has d_vocab={prefix.last_logits.shape[-1]}")
    residuals = prefix.residuals or ()
    widths = {tuple(r.shape) for r in residuals}
    if residuals and (
        len(residuals) != backend.n_layers or widths != {(*prefix.tokens.shape, backend.d_model)}
    ):
        wrong.append(f"prefix.residuals are {len(residuals)} of shapes {sorted(widths)}")
    if wrong:
        raise CacheConfigError(
            f"ablate_write: model does not fit the prefix: {'; '.join(wrong)}, but the model "
            f"has d_vocab_out={backend.d_vocab}, n_layers={backend.n_layers}, "
            f"d_model={backend.d_model}. Pass the model the prefix was run through"
        )
    cfg = getattr(backend, "cfg", None)
    normed = cfg is not None and (cfg.use_qk_norm or cfg.original_architecture in _NORMED_KEYS)
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
    return backend


def ablate_write(
    model: SupportedModel, prefix: Prefix, ablations: Ablation | Sequence[Ablation]
) -> Prefix:
    """Write-time ablation: the prefix recomputed with the edit in its keys/values.

    On a `HookedTransformer` the edit is applied at `blocks.{l}.attn.hook_k` / `hook_v`
    (hooks attached for this thread's recomputation only, removed after it, also on
    error), so the result equals one TransformerLens `run_with_hooks` over the prefix
    with the same edit there, on every model; a `"function"` ablation's `fn` gets slices
    of those activations (before any q/k norm or `clip_qkv`). On a HuggingFace model it
    is applied to the new keys/values as the recomputation stores them (the cache's
    `hook_k_new` / `hook_v_new`: head-major, keys after the rotary embedding), which
    equals an uncached forward with the keys/values handed to attention edited there.
    `"mean"` and `"resample"` write the references' cached keys/values. Positions
    before the first edited one are reused from `prefix`; when `prefix` kept its
    residuals, layers before the first edited one are reused too. The source prefix
    and the references are unchanged.

    **Arguments:**

    - `model`: the model the prefix was run through (a `HookedTransformer` or a
      HuggingFace causal LM).
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
    backend = _backend(model, prefix, edits)
    n_layers = backend.n_layers
    plan: dict[int, list[_Edit]] = {}
    for edit in edits:
        for layer in edit.layers:
            plan.setdefault(layer, []).append(edit)
    start = min(int(edit.positions.min()) for edit in edits)
    reuse = prefix.residuals is not None and backend.reuses_residuals
    skip = min(plan) if reuse else 0
    cache = backend.working_cache(prefix.cache, start, skip if reuse else None)

    def editor(layer: int, target: str) -> Callable[[torch.Tensor, Any], torch.Tensor]:
        def edit(tensor: torch.Tensor, hook: Any) -> torch.Tensor:
            for item in plan[layer]:
                if target in item.ablation.targets():
                    tensor = item.apply(tensor, layer, target, start)
            return tensor

        return edit

    hooks: list[tuple[str, Hook]] = [
        (backend.write_hook(layer, target), editor(layer, target))  # type: ignore[arg-type]
        for layer, items in plan.items()
        for target in ("keys", "values")
        if any(target in item.ablation.targets() for item in items)
    ]
    residuals: dict[int, torch.Tensor] = {}

    def keeper(layer: int) -> Hook:
        def keep(resid: torch.Tensor, hook: Any) -> None:
            residuals[layer] = resid

        return keep

    if reuse:
        hooks += [(backend.residual_hook(i), keeper(i)) for i in range(skip, n_layers)]
    with torch.no_grad(), backend.pass_hooks(cache, hooks):
        if prefix.residuals is not None and reuse:
            residual = prefix.residuals[skip][:, start:]
            logits = backend.forward_from_layer(residual, skip, prefix.attention_mask, cache)
        else:
            logits = backend.forward(prefix.tokens[:, start:], prefix.attention_mask, cache)
    cache.freeze()
    kept = None
    if prefix.residuals is not None and reuse:
        kept = tuple(
            prefix.residuals[i]
            if i < skip
            else torch.cat([prefix.residuals[i][:, :start], residuals[i]], dim=1)
            for i in range(n_layers)
        )
    return Prefix(cache, prefix.tokens, prefix.attention_mask, logits[:, -1], kept)

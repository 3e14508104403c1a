"""The TransformerLens `HookedTransformer` adapter: `HookedBackend` and `KeyValueCache`'s ops.

A `HookedTransformer` takes a safelens [`KeyValueCache`][safelens.KeyValueCache] as
`past_kv_cache=`. The cache holds position-major `[batch, pos, n_kv_heads, d_head]`
keys *before* the rotary embedding (TransformerLens rotates the whole cached sequence
on every pass) and the attention mask of every cached position, so a pass is given only
the new tokens' mask. Hook names are TransformerLens' (`blocks.{l}.attn.hook_k`, …) and
the cache's `blocks.{l}.kv_cache.{hook_k_new, hook_v_new, hook_k_full, hook_v_full}`.

What this family offers beyond plain passes:

- continuations run under [`shared_prefix_attention`][safelens.shared_prefix_attention],
  which reads a broadcast prefix once per layer;
- write-time edits at `blocks.{l}.attn.hook_k` / `hook_v`, and a prefix's kept residual
  stream (`blocks.{l}.hook_resid_pre`), so a write-time ablation recomputes only the
  layers from the first edited one (not on shortformer models, whose attention reads
  the positional embedding beside the residual stream);
- safelens' own passes attach their hooks with `thread_hooks`, acting on the calling
  thread's passes only.

Caveat: TransformerLens is imported when a method needs it, not with this module, so
recognising a model (`backend_of`) imports nothing; models built with
`ungroup_grouped_query_attention=True` are refused (see `refuse_ungrouped`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch

from ...core._cache import KeyValueCache
from ...core._config import CacheDimensions, refuse_ungrouped
from ...core._errors import CacheShapeError, PatchingError
from ...core._thread_hooks import thread_hooks
from .._backend import Backend, FwdHooks, NamesFilter
from .._cache_ops import CacheLayout, CacheOps, CacheShape
from .._sites import TL_NAMES, Site

__all__ = ["KEY_VALUE_CACHE", "HookedBackend", "lacks"]


class KeyValueCacheOps(CacheOps):
    """[`CacheOps`][safelens.backends._cache_ops.CacheOps] of a `KeyValueCache`."""

    layout = CacheLayout(
        pos_axis=1, heads_axis=2, rotary="pre", hook_prefix="blocks.{layer}.kv_cache"
    )
    cache_class_name = "KeyValueCache"
    keeps_mask = True

    def shape(self, cache: Any, what: str) -> CacheShape:
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
                f"{what} holds keys/values of several shapes {sorted(shapes)}; every layer "
                "must be one [batch, pos, n_kv_heads, d_head] shape"
            )
        return CacheShape(len(entries), *shapes.pop())

    def layer(self, cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        entry = cache[layer]
        return entry.keys, entry.values

    def stored_mask(self, cache: Any) -> torch.Tensor | None:
        mask = cache.previous_attention_mask
        return mask if isinstance(mask, torch.Tensor) else None

    def is_frozen(self, cache: Any) -> bool:
        return bool(cache.frozen) and all(entry.frozen for entry in cache)

    def replaced(self, cache: Any, layers: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Any:
        result = cache.fork()
        for layer, (keys, values) in layers.items():
            entry = result[layer]
            entry.keys, entry.values = keys, values
        result.freeze()
        return result

    def cropped(self, cache: Any, length: int) -> Any:
        return cache.crop(length)

    def length(self, cache: Any) -> int:
        return int(cache.sequence_length)

    def batch_size(self, cache: Any) -> int:
        return int(cache.batch_size)


KEY_VALUE_CACHE = KeyValueCacheOps()


class HookedBackend(Backend):
    """A TransformerLens `HookedTransformer`, as the experiments see it."""

    family = "hooked"
    clean_cache_call = "model.run_with_cache(clean_tokens)"
    caches = KEY_VALUE_CACHE

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        cfg = model.cfg
        self.cfg = cfg
        self.n_layers = cfg.n_layers
        self.d_vocab = cfg.d_vocab_out
        self.n_ctx = cfg.n_ctx
        self.d_model = cfg.d_model
        self.device = torch.device(cfg.device) if cfg.device is not None else torch.device("cpu")
        self.reuses_residuals = cfg.positional_embedding_type != "shortformer"
        self._dims = CacheDimensions.of(cfg)
        self.n_kv_heads, self.d_head, self.dtype = (
            self._dims.n_kv_heads,
            self._dims.d_head,
            self._dims.dtype,
        )

    @property
    def n_token_ids(self) -> int:
        return int(self.cfg.d_vocab)  # `d_vocab_out` (the logits') may differ

    def layer_device(self, layer: int) -> torch.device:
        weight = next(self.model.blocks[layer].parameters(), None)  # `cfg.n_devices > 1`
        return self.device if weight is None else weight.device

    def check_model(self, what: str) -> None:
        refuse_ungrouped(self.cfg, what)

    def patch_site(self, activation: str, clean_cache: Any = None) -> Site:
        """TransformerLens' hook points, where the model has the activation (`lacks`)."""
        name = f"blocks.0.{TL_NAMES.get(activation, activation)}"
        why = lacks(self.cfg, name)
        if why is not None:
            raise PatchingError(f"model has no activation {name!r}: {why}")
        return super().patch_site(activation, clean_cache)

    def bidirectional(self) -> str | None:
        """`cfg.attention_dir`, or the first layer whose own override is not causal."""
        for layer, block in enumerate(self.model.blocks):
            override = getattr(block.attn, "_attention_dir_override", None)
            if (override or self.cfg.attention_dir) == "causal":
                continue
            if override is None:
                return f"cfg.attention_dir={self.cfg.attention_dir!r}"
            return f"blocks.{layer}.attn attends {override!r}"
        return None

    # -- tokens -------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return getattr(self.model, "tokenizer", None)

    def to_tokens(self, text: str | list[str]) -> torch.Tensor:
        tokens: torch.Tensor = self.model.to_tokens(text)
        return tokens

    def default_mask(self, tokens: torch.Tensor) -> torch.Tensor:
        """TransformerLens' `get_attention_mask` where its forward builds one, else ones.

        Its forward masks a tokenizer's leading padding in every batch when the
        tokenizer pads on the left (a lone prompt too); trailing padding of a batch is
        masked too, and refused where a prefix ends in it.
        """
        tokenizer = self.tokenizer
        left = getattr(tokenizer, "padding_side", None) == "left"
        if tokenizer is not None and (left or tokens.shape[0] > 1):
            from transformer_lens.utilities import get_attention_mask

            mask: torch.Tensor = get_attention_mask(
                self.tokenizer, tokens, self.cfg.default_prepend_bos
            )
            return mask.long()
        return torch.ones_like(tokens, dtype=torch.long)

    # -- caches and passes ----------------------------------------------------------------

    def empty_cache(self, batch: int) -> KeyValueCache:
        return KeyValueCache.init_cache(self.cfg, self.cfg.device, batch_size=batch)

    def check_cache(self, cache: Any, what: str) -> None:
        if not isinstance(cache, KeyValueCache):
            raise TypeError(
                f"{what}: a HookedTransformer reads a safelens KeyValueCache, got "
                f"{type(cache).__name__}; make the prefix with prefill(model, tokens)"
            )
        cache.check_fits(self.cfg)

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor, cache: Any) -> Any:
        past = int(cache.sequence_length)
        return self.model(tokens, attention_mask=attention_mask[:, past:], past_kv_cache=cache)

    def forward_continuations(
        self, tokens: torch.Tensor, attention_mask: torch.Tensor, cache: Any
    ) -> Any:
        from ._shared_attention import shared_prefix_attention

        with shared_prefix_attention(self.model):
            return self.forward(tokens, attention_mask, cache)

    def write_hook(self, layer: int, target: Literal["keys", "values"]) -> str:
        return f"blocks.{layer}.attn.hook_{target[0]}"

    @contextmanager
    def pass_hooks(self, cache: Any, fwd_hooks: FwdHooks) -> Iterator[None]:
        """Model hooks act on this thread's passes only (`thread_hooks`); cache hooks on `cache`."""
        cache_points, model_points = [], []
        for names, fn in fwd_hooks:
            for name in [names] if isinstance(names, str) else names:  # type: ignore[union-attr]
                if name in self.model.hook_dict:
                    model_points.append((self.model.hook_dict[name], fn))
                else:
                    layer, point = int(name.split(".")[1]), name.rsplit(".", 1)[1]
                    cache_points.append((getattr(cache[layer], point), fn))
        level = -id(cache_points)  # a level no context manager of TransformerLens uses
        try:
            for point, fn in cache_points:
                point.add_hook(fn, level=level)
            with thread_hooks(model_points):
                yield
        finally:
            for point, _ in cache_points:
                point.remove_hooks(level=level)

    # -- run_with_hooks --------------------------------------------------------------------

    def cache_hook_names(self) -> list[str]:
        from ._hooks import cache_hook_names

        return cache_hook_names(self.n_layers)

    def select_cache_hooks(self, names: NamesFilter) -> list[str]:
        from ._hooks import _resolve

        return _resolve(self.model, names, True)[1]

    def hooks(
        self, cache: Any, fwd_hooks: FwdHooks, reset_hooks_end: bool, clear_contexts: bool
    ) -> Any:
        from ._hooks import hooks

        return hooks(self.model, cache, fwd_hooks, reset_hooks_end, clear_contexts)

    def run(
        self,
        input: Any,
        cache: Any,
        fwd_hooks: FwdHooks,
        forward_args: dict[str, Any],
        reset_hooks_end: bool,
        clear_contexts: bool,
    ) -> Any:
        from ._run import run

        return run(self, input, cache, fwd_hooks, forward_args, reset_hooks_end, clear_contexts)

    # -- the residual fast path -----------------------------------------------------------

    def residual_hook(self, layer: int) -> str:
        return f"blocks.{layer}.hook_resid_pre"

    def working_cache(self, prefix_cache: Any, start: int, skip: int | None) -> Any:
        cropped = prefix_cache.crop(start)
        if skip is None:
            return cropped
        full = prefix_cache.fork()
        # Layers before `skip` hold the whole prefix, later ones its first `start`
        # positions, and the mask is the whole prefix's (a pass that starts at a layer
        # reads it, appends none): a cache the constructor would refuse, so assembled.
        return KeyValueCache.assembled(
            {i: full[i] if i < skip else cropped[i] for i in range(self.n_layers)},
            prefix_cache.previous_attention_mask,
        )

    def forward_from_layer(
        self, residual: torch.Tensor, layer: int, attention_mask: torch.Tensor, cache: Any
    ) -> Any:
        return self.model(
            residual, start_at_layer=layer, attention_mask=attention_mask, past_kv_cache=cache
        )


def lacks(cfg: Any, name: str) -> str | None:
    """Why a `HookedTransformer` of config `cfg` has no activation at hook `name`, or `None`."""
    if cfg.attn_only and ("mlp" in name or "ln2" in name or "resid_mid" in name):
        return (
            "the model is attention-only (cfg.attn_only=True) and has no MLP layers, so "
            "there is nothing to patch there; patch attn_out, z or resid_pre instead"
        )
    if cfg.parallel_attn_mlp and "resid_mid" in name:
        return (
            "the model runs attention and MLP in parallel (cfg.parallel_attn_mlp=True), so "
            "no residual stream lies between them; patch attn_out or resid_pre instead"
        )
    return None

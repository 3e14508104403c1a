"""The TransformerBridge adapter: `BridgeBackend`.

TransformerLens' `TransformerBridge` (TransformerLens 3.9 and 4.x) wraps a HuggingFace
causal LM, whose attention the bridge re-implements with TransformerLens hook points.
Its cache is the HuggingFace one, an [`HFKeyValueCache`][safelens.HFKeyValueCache]:
head-major `[batch, n_kv_heads, pos, d_head]` keys *after* the rotary embedding, no
stored attention mask. So `BridgeBackend` is `HFBackend` (sizes, position ids from the
full mask, write-time edits at the cache's `hook_k_new` / `hook_v_new`) with three
differences:

- every pass goes through the bridge, so the bridge's hooks fire, inside
  [`cache_pass`][safelens.backends.bridge._cache_pass.cache_pass], which makes the
  cache reach the bridge's attention under every transformers version (the >= 5.24
  `cache=` rename, which the bridge's attention does not read) or refuses the pass.
  Where no hook of the user's is attached, passes whose numbers it checks run on
  `plain()`, the model without the bridge's components (`._plain`), which gives the
  same numbers faster: a patching sweep's patched passes, and (`twin`, checked by
  `same_numbers` on the prefix's last position) `prefill`, `score_continuations` and
  `generate`;
- hook names are the bridge's (`blocks.{l}.attn.hook_q`, …) and the cache's, named
  to match: `blocks.{l}.kv_cache.{hook_k_new, hook_v_new, hook_k_full, hook_v_full}`
  (`HFKeyValueCache(naming="bridge")`); see `safelens.backends.bridge._hooks`;
- text is tokenized by the bridge's `to_tokens` (left padding).

Caveat: hooks on the bridge's own hook points act on every thread's passes while
attached (TransformerLens' bookkeeping); cache hooks and the cache itself are the
pass's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Literal

import torch

from ...core._thread_hooks import hooked_anywhere
from .._backend import Backend, FwdHooks, NamesFilter
from .._cache_ops import CacheLayout
from .._sites import Site
from ..hf._backend import HFBackend, HFCacheOps, pass_inputs
from ..hf._cache import HFKeyValueCache
from ..hf._model import forward_cache_argument
from ._cache_pass import cache_pass
from ._hooks import bridge_hooks, select_cache_hooks, thread_bridge_hooks
from ._plain import agrees, plain_model
from ._sites import bridge_site

__all__ = ["BRIDGE_CACHE", "BridgeBackend"]


class BridgeCacheOps(HFCacheOps):
    """An `HFKeyValueCache`'s ops, with the bridge's cache hook names."""

    layout = CacheLayout(
        pos_axis=2, heads_axis=1, rotary="post", hook_prefix="blocks.{layer}.kv_cache"
    )


BRIDGE_CACHE = BridgeCacheOps()
_POINTS = ("hook_k_new", "hook_v_new", "hook_k_full", "hook_v_full")


class BridgeBackend(HFBackend):
    """A TransformerLens `TransformerBridge`, as the experiments see it."""

    family = "bridge"
    clean_cache_call = "bridge.run_with_cache(clean_tokens)"
    caches = BRIDGE_CACHE

    def __init__(self, model: Any) -> None:
        super().__init__(model.original_model)
        self.model = model

    def check_model(self, what: str) -> None:
        forward_cache_argument(self.model.original_model)

    def to_tokens(self, text: str | list[str]) -> torch.Tensor:
        tokens: torch.Tensor = self.model.to_tokens(text, padding_side="left")
        return tokens

    def empty_cache(self, batch: int) -> HFKeyValueCache:
        return HFKeyValueCache(config=self._sizes, naming="bridge")

    def check_cache(self, cache: Any, what: str) -> None:
        super().check_cache(cache, what)
        if cache.naming != "bridge":
            raise TypeError(
                f"{what}: a TransformerBridge reads an HFKeyValueCache(naming='bridge'), whose "
                f"hook names are blocks.{{layer}}.kv_cache.…; got naming={cache.naming!r}. Make "
                "the prefix with prefill(bridge, tokens)"
            )

    def _call(
        self,
        tokens: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: Any,
        last_only: bool = False,
    ) -> Any:
        """The bridge's logits for `tokens` after `cache`'s positions, `attention_mask` full.

        `last_only` keeps the last position's; every position is computed (the bridge's
        hooks may read any).
        """
        mask, positions = pass_inputs(attention_mask, self.caches.length(cache), tokens.shape[1])
        with cache_pass(self.model, cache) as argument:
            logits = self.model(
                tokens, attention_mask=mask, position_ids=positions, use_cache=True, **argument
            )
        return logits[:, -1:] if last_only else logits

    def forward_continuations(
        self, tokens: torch.Tensor, attention_mask: torch.Tensor, cache: Any
    ) -> Any:
        """Plain passes: the bridge's attention is its own, with no shared-prefix read."""
        return self._call(tokens, attention_mask, cache)

    def patch_site(self, activation: str, clean_cache: Any = None) -> Site:
        """Its hook points, keys and values at its cache (`safelens.backends.bridge._sites`)."""
        return bridge_site(self, activation, clean_cache)

    def read_site(self, activation: str) -> Site:
        """TransformerLens' hook points, as on a `HookedTransformer`."""
        return Backend.read_site(self, activation)

    def qk_sites(self) -> dict[str, Site]:
        return Backend.qk_sites(self)

    def plain(self) -> HFBackend | None:
        """An `HFBackend` of the bridge's model without its components, or `None` (`._plain`)."""
        model = plain_model(self.model)
        return None if model is None else HFBackend(model)

    def twin(self) -> Backend:
        """`plain()` while no hook of the user's is attached anywhere in the bridge, else `self`."""
        if hooked_anywhere(self.model):
            return self
        return self.plain() or self

    def same_numbers(
        self, twin: Backend, cache: Any, tokens: torch.Tensor, attention_mask: torch.Tensor
    ) -> bool:
        """Whether `twin` gives the bridge's logits for the last of `tokens` after the others.

        One pass of that position through each, on branches of `cache` cropped before it;
        a twin whose pass raises does not.
        """
        if twin is self:
            return True
        last = tokens[:, -1:]
        ours = self.forward(last, attention_mask, cache.cropped(-1))
        try:
            theirs = twin.forward(last, attention_mask, cache.cropped(-1))
        except Exception:  # noqa: BLE001 - no hook of the user's is attached: the twin's own
            return False
        return agrees(theirs, ours)

    def write_hook(self, layer: int, target: Literal["keys", "values"]) -> str:
        return BRIDGE_CACHE.layout.hook_name(layer, f"hook_{target[0]}_new")

    @contextmanager
    def pass_hooks(self, cache: Any, fwd_hooks: FwdHooks) -> Iterator[None]:
        """Cache hooks on `cache`; bridge hooks on this thread's passes only."""
        with thread_bridge_hooks(self, cache, fwd_hooks):
            yield

    def cache_hook_names(self) -> list[str]:
        return [BRIDGE_CACHE.layout.hook_name(i, p) for i in range(self.n_layers) for p in _POINTS]

    def select_cache_hooks(self, names: NamesFilter) -> list[str]:
        return select_cache_hooks(self, names)

    def hooks(
        self, cache: Any, fwd_hooks: FwdHooks, reset_hooks_end: bool, clear_contexts: bool
    ) -> AbstractContextManager[Any]:
        return bridge_hooks(self, cache, fwd_hooks, reset_hooks_end, clear_contexts)

"""The adapter protocol: what the experiments need from a model family.

The experiments (`safelens.experiments`: prefill, continuations, generation, ablations,
hooked runs, capture) are written once against two small interfaces defined here:

- [`Backend`][safelens.backends._backend.Backend] wraps one model: its sizes, its
  tokenizer, an empty cache for a batch, one forward pass of new tokens through a cache,
  the hook names where an edit is written into the cache, and hooks attached for a
  pass. One subclass per model family: `HookedBackend`
  (`safelens.backends.hooked._backend`, TransformerLens `HookedTransformer`), `HFBackend`
  (`safelens.backends.hf._backend`, plain HuggingFace causal LMs) and `BridgeBackend`
  (`safelens.backends.bridge._backend`, TransformerLens' `TransformerBridge`).
- [`CacheOps`][safelens.backends._cache_ops.CacheOps] is what an experiment does to a
  cache without the model (`safelens.backends._cache_ops`).

[`backend_of`][safelens.backends._families.backend_of] recognises a model's family by the
names and modules of its class and its bases, importing a family's adapter (and so its
model library) only when the model is of that family: `import safelens` and the
experiments need neither TransformerLens nor transformers.

Caveat: positions and heads mean the cache's axes, in the cache's layout, on every
backend: a position counts left padding, a head is a key/value head under grouped-query
attention, and a `"function"` ablation or a write-time hook gets tensors in that
backend's layout (`[batch, pos, n_kv_heads, d_head]` on `HookedTransformer`,
`[batch, n_kv_heads, pos, d_head]` on HuggingFace models and the bridge).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from collections.abc import Sequence as Seq
from contextlib import AbstractContextManager
from typing import Any, ClassVar, Literal

import torch
from jaxtyping import Float, Int

from ._cache_ops import CacheOps
from ._sites import Site, tl_heads, tl_site

__all__ = [
    "Backend",
    "FwdHooks",
    "NamesFilter",
]

NamesFilter = str | Seq[str] | Callable[[str], bool]
FwdHooks = Seq[tuple[NamesFilter, Callable[[torch.Tensor, Any], Any]]]


class Backend(ABC):
    """One model of one family, as the experiments see it.

    A backend is a thin, cheap wrapper made per call (`backend_of(model)`); it holds
    `model` and nothing that outlives a call. Subclasses set the class attributes and
    fill the sizes in `__init__`.

    **Sizes** (instance attributes): `n_layers`, `d_vocab` (width of the logits),
    `n_ctx` (longest sequence the model takes, `None` when unbounded), `d_model`,
    `n_kv_heads`, `d_head`, `device` and `dtype` (of the cache the model writes);
    `n_token_ids` (the token ids the model embeds) and `layer_device(layer)` (where a
    layer computes) where a family's differ from `d_vocab` and `device`.

    **Contract of a forward pass** ([`forward`][safelens.backends._backend.Backend.forward]):
    new tokens `[batch, new_tokens]` go through `cache`, which holds `past` positions;
    `attention_mask` is the *full* mask `[batch, past + new_tokens]` (0 on padding:
    left padding in the prefix, right padding after a continuation). The model must see
    each real token at the position HuggingFace's `generate` gives it: the number of
    real tokens before it in its row (`attention_mask.cumsum(-1) - 1`), so that a
    left-padded row gives the numbers of the same row unpadded. The pass stores into
    `cache` unless it is frozen; if it raises, `cache` is as it was.

    **Hooks** are `fn(tensor, hook) -> tensor | None`, TransformerLens' protocol; `hook`
    has at least `.name`. A backend's names are its cache hook names
    (`caches.layout.hook_name(layer, point)`) and its model's own names (TransformerLens
    hook points; on HuggingFace models, module names). The write-time seam
    ([`write_hook`][safelens.backends._backend.Backend.write_hook]) is the hook whose
    tensor is the new keys/values a pass is about to store, in `caches.layout`,
    covering only the positions that pass computes; the read-time seam
    ([`read_hook`][safelens.backends._backend.Backend.read_hook]) is the cache's copy of
    everything attention reads.

    **Fast paths** are capabilities a backend may offer; the experiments fall back to
    plain forward passes when a backend says it has none:

    - [`forward_continuations`][safelens.backends._backend.Backend.forward_continuations]:
      the one place a batch of continuations of a broadcast prefix is run, so a backend
      can read the shared prefix once per layer (default: `forward`).
    - `reuses_residuals` (set per model) with `residual_hook` and `forward_from_layer`:
      a prefix may keep the residual stream entering each layer, and a write-time
      ablation then recomputes only the layers from the first edited one.
    - [`twin`][safelens.backends._backend.Backend.twin] with
      [`same_numbers`][safelens.backends._backend.Backend.same_numbers]: another
      backend that runs this model's unhooked passes faster with its numbers (default:
      none, `self`).
    """

    family: ClassVar[str]
    caches: ClassVar[CacheOps]
    # The call that makes a patching sweep's clean cache of this family, for messages.
    clean_cache_call: ClassVar[str]
    reuses_residuals: bool = False

    model: Any
    n_layers: int
    d_vocab: int
    n_ctx: int | None
    d_model: int
    n_kv_heads: int
    d_head: int
    device: torch.device
    dtype: torch.dtype

    def __init__(self, model: Any) -> None:
        self.model = model

    @property
    def n_token_ids(self) -> int:
        """Token ids the model embeds, `[0, n_token_ids)`: `d_vocab`, unless its inputs differ."""
        return self.d_vocab

    def layer_device(self, layer: int) -> torch.device:
        """The device layer `layer` computes on (a model spread over devices): `device` here."""
        return self.device

    @abstractmethod
    def check_model(self, what: str) -> None:
        """Refuse, naming `what`, a model of this family that safelens cannot run (why, and the fix).

        [`backend_of`][safelens.backends._families.backend_of] calls it after
        construction. **Raises:** [`CacheConfigError`][safelens.CacheConfigError].
        """

    def bidirectional(self) -> str | None:
        """Why the model's attention reads later positions (a config flag), or `None` (causal).

        A prefix of such a model cannot be cached for continuations: its positions'
        keys and values depend on the tokens after them.
        """
        return None

    # -- tokens -------------------------------------------------------------------------

    @property
    @abstractmethod
    def tokenizer(self) -> Any:
        """The model's tokenizer, or `None` (random-weight or self-trained models)."""

    @abstractmethod
    def to_tokens(self, text: str | list[str]) -> Int[torch.Tensor, "batch pos"]:
        """Token ids of `text` (a batch of texts left-padded), as the model's family does."""

    @abstractmethod
    def default_mask(
        self, tokens: Int[torch.Tensor, "batch pos"]
    ) -> Int[torch.Tensor, "batch pos"]:
        """The attention mask of `tokens` when the caller gives none (padding from the tokenizer, else ones)."""

    # -- caches and passes ----------------------------------------------------------------

    @abstractmethod
    def empty_cache(self, batch: int) -> Any:
        """A new, empty, unfrozen cache for `batch` rows, of `caches`' class."""

    @abstractmethod
    def check_cache(self, cache: Any, what: str) -> None:
        """Refuse a cache this model cannot read.

        **Raises:** `TypeError` for a cache of another class;
        [`CacheConfigError`][safelens.CacheConfigError] naming `what` when its layers,
        key/value heads, `d_head` or dtype differ from the model's.
        """

    @abstractmethod
    def forward(
        self,
        tokens: Int[torch.Tensor, "batch new_tokens"],
        attention_mask: Int[torch.Tensor, "batch pos"],
        cache: Any,
    ) -> Float[torch.Tensor, "batch new_tokens d_vocab"]:
        """Logits of one pass of `tokens` through `cache` (see the class notes)."""

    def forward_last(
        self,
        tokens: Int[torch.Tensor, "batch new_tokens"],
        attention_mask: Int[torch.Tensor, "batch pos"],
        cache: Any,
    ) -> Float[torch.Tensor, "batch d_vocab"]:
        """`forward`'s logits at the last position (a backend may skip the others')."""
        return self.forward(tokens, attention_mask, cache)[:, -1]

    def forward_continuations(
        self,
        tokens: Int[torch.Tensor, "batch new_tokens"],
        attention_mask: Int[torch.Tensor, "batch pos"],
        cache: Any,
    ) -> Float[torch.Tensor, "batch new_tokens d_vocab"]:
        """`forward` for continuations (right-padded) of a frozen cache from `expand(n)`.

        The single place where a batch of continuations runs; override it to read the
        broadcast prefix once per layer. Must give `forward`'s numbers to float rounding.
        """
        return self.forward(tokens, attention_mask, cache)

    def twin(self) -> Backend:
        """A backend to run this model's unhooked passes on: `self`, or a faster stand-in.

        Asked once per experiment call, before its passes, by experiments that attach no
        hook of their own (`prefill`, `score_continuations`, `generate`); a stand-in is
        used only where [`same_numbers`][safelens.backends._backend.Backend.same_numbers]
        holds on the call's prefix. A TransformerBridge with no hook of the user's
        attached answers its plain HuggingFace model (`safelens.backends.bridge._plain`).
        """
        return self

    def same_numbers(
        self,
        twin: Backend,
        cache: Any,
        tokens: Int[torch.Tensor, "batch pos"],
        attention_mask: Int[torch.Tensor, "batch pos"],
    ) -> bool:
        """Whether `twin` gives this backend's logits after `cache`, which holds `tokens`.

        Checked on a pass of the last position of `tokens` over the others (on branches
        of `cache`, which is not changed); `True` for `twin is self`.
        """
        return twin is self

    @abstractmethod
    def write_hook(self, layer: int, target: Literal["keys", "values"]) -> str:
        """The write-time seam of `layer`: the hook name whose tensor is what is stored.

        `blocks.{l}.attn.hook_k` on `HookedTransformer`; the cache's own
        `model.layers.{l}.kv_cache.hook_k_new` on HuggingFace models.
        """

    def read_hook(self, layer: int, target: Literal["keys", "values"]) -> str:
        """The read-time seam of `layer`: the cache hook whose tensor attention reads.

        `hook_k_full` / `hook_v_full` (all cached + new positions, a copy: an edit there
        changes this pass only). A backend whose caches name hooks otherwise overrides it.
        """
        return self.caches.layout.hook_name(layer, f"hook_{target[0]}_full")

    @abstractmethod
    def pass_hooks(self, cache: Any, fwd_hooks: FwdHooks) -> AbstractContextManager[None]:
        """Attach `fwd_hooks` (listed names only) for safelens' own passes through `cache`.

        Names may be model or cache hook names. Hooks on the model act on the calling
        thread's passes only where the family allows (say so in the subclass). Removed
        on exit, also on error.
        """

    # -- run_with_hooks --------------------------------------------------------------------

    @abstractmethod
    def cache_hook_names(self) -> list[str]:
        """Every cache hook name of this model, in layer order."""

    @abstractmethod
    def select_cache_hooks(self, names: NamesFilter) -> list[str]:
        """The cache hook names `names` selects; a model hook name is a `HookError`."""

    @abstractmethod
    def hooks(
        self, cache: Any, fwd_hooks: FwdHooks, reset_hooks_end: bool, clear_contexts: bool
    ) -> AbstractContextManager[Any]:
        """`run_with_hooks`' hooks: model and cache names mixed, names checked first.

        Hooks attached here are removed on exit (with `reset_hooks_end`), also on
        error; a pass that fails inside the block leaves `cache` as it was.

        **Raises:** [`HookError`][safelens.HookError] for an unknown name (with near
        matches) or a hook that is not callable; nothing is attached then.
        """

    @abstractmethod
    def run(
        self,
        input: Any,
        cache: Any,
        fwd_hooks: FwdHooks,
        forward_args: dict[str, Any],
        reset_hooks_end: bool,
        clear_contexts: bool,
    ) -> Any:
        """`run_with_hooks`' pass: check everything, attach `fwd_hooks` (as `hooks`), run.

        `forward_args` holds `run_with_hooks`' keyword arguments (TransformerLens'
        `forward` arguments: `attention_mask`, `return_type`, …); a family refuses, with
        a `ValueError` naming it, one it cannot honour. Nothing is attached or run
        before the checks pass; a failed pass leaves `cache` and the hooks as they were.
        """

    # -- the residual fast path -----------------------------------------------------------

    def residual_hook(self, layer: int) -> str:
        """The hook whose tensor is the residual stream entering `layer` `[batch, pos, d_model]`."""
        raise NotImplementedError(f"{self.family} models do not reuse residuals")

    def working_cache(self, prefix_cache: Any, start: int, skip: int | None) -> Any:
        """A new unfrozen cache to recompute positions `start…` of `prefix_cache`.

        `skip=None`: for a `forward` of the tokens from `start` (every layer holds the
        first `start` positions). An int: for `forward_from_layer(..., skip)`, asked only
        of a backend with `reuses_residuals` (layers before `skip` share every position
        of `prefix_cache`, as they are not run). `prefix_cache` is not changed.
        """
        if skip is not None:
            raise NotImplementedError(f"{self.family} models do not reuse residuals")
        return self.caches.cropped(prefix_cache, start)

    def forward_from_layer(
        self,
        residual: Float[torch.Tensor, "batch new_tokens d_model"],
        layer: int,
        attention_mask: Int[torch.Tensor, "batch pos"],
        cache: Any,
    ) -> Float[torch.Tensor, "batch new_tokens d_vocab"]:
        """Logits of a pass that starts at `layer` from `residual`, through `cache`.

        `cache` comes from `working_cache(prefix_cache, past, layer)`;
        `attention_mask` is the full mask `[batch, past + new_tokens]`.
        """
        raise NotImplementedError(f"{self.family} models do not reuse residuals")

    # -- patching sites (`safelens.backends._sites`) ----------------------------------------

    def patch_site(self, activation: str, clean_cache: Any = None) -> Site:
        """Where a patching sweep writes `activation` of each layer, and its clean cache's name.

        `activation` is TransformerLens' short name (`k`, `resid_pre`, …; `TL_NAMES`);
        `clean_cache` may settle where (a bridge's keys without `attn.hook_rot_k`). Here
        TransformerLens' hook points; a family with other seams declares its own.

        **Raises:** `PatchingError` where the family has no such activation, saying why.
        """
        return tl_site(activation, tl_heads(self, activation))

    def read_site(self, activation: str) -> Site:
        """Where attribution reads `activation` of each layer and its gradient."""
        return tl_site(activation, tl_heads(self, activation))

    def qk_sites(self) -> dict[str, Site]:
        """The QK fix's sites by role, or a `PatchingError` where the family has none.

        Roles: `qk_q`, `qk_k` the queries and keys attention scores (after the rotary
        embedding), `scores` its scores before the softmax, `pattern` its pattern.
        """
        heads = tl_heads(self, "q")
        rotary = "blocks.0.attn.hook_rot_q" in self.model.hook_dict
        q, k = ("attn.hook_rot_q", "attn.hook_rot_k") if rotary else ("attn.hook_q", "attn.hook_k")
        return {
            "qk_q": tl_site("q", heads, q),
            "qk_k": tl_site("k", self.n_kv_heads, k),
            "scores": tl_site("scores", heads, "attn.hook_attn_scores"),
            "pattern": tl_site("pattern", heads),
        }

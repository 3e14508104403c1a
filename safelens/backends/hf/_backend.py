"""The HuggingFace causal-LM adapter: `HFBackend` and `HFKeyValueCache`'s ops.

A HuggingFace causal LM takes a safelens [`HFKeyValueCache`][safelens.HFKeyValueCache]
under the name [`hf_cache_argument`][safelens.hf_cache_argument] gives (`cache=` on
transformers >= 5.24, else `past_key_values=`). The cache holds head-major
`[batch, n_kv_heads, pos, d_head]` keys *after* the rotary embedding and no attention
mask, so every pass is given the full mask (cached + new positions) and position ids
computed from it as HuggingFace's `generate` does (`mask.cumsum(-1) - 1`, 0 on
padding), so a left-padded row gives the numbers of the same row unpadded.

Hook names: the cache's `model.layers.{l}.kv_cache.{hook_k_new, hook_v_new,
hook_k_full, hook_v_full}` and the model's module names (`model.layers.0.mlp`, …); see
`safelens.backends.hf._run`. Write-time edits go through the cache's `hook_k_new` /
`hook_v_new` (what a pass stores). There is no residual fast path: a write-time
ablation reruns every layer from the first edited position.

Caveat: a HuggingFace model carries no tokenizer; text is tokenized only when one is
set as `model.tokenizer`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from types import SimpleNamespace
from typing import Any, Literal

import torch

from ...core._config import CacheDimensions
from ...core._errors import CacheShapeError
from ...core._fit import check_fits
from ...core._storage import Sequence
from .._backend import Backend, FwdHooks, NamesFilter
from .._cache_ops import CacheLayout, CacheOps, CacheShape
from .._sites import Site
from ._cache import HFKeyValueCache
from ._layer import HFCacheLayer
from ._model import (
    check_cacheable,
    forward_cache_argument,
    forward_parameters,
    hf_cache_argument,
)
from ._run import attach_hooks, module_hooks, run, select_cache_hooks
from ._shared_attention import shared_prefix
from ._sites import hf_site, layer_device

__all__ = ["HF_CACHE", "HFBackend", "pass_inputs"]


class HFCacheOps(CacheOps):
    """[`CacheOps`][safelens.backends._cache_ops.CacheOps] of an `HFKeyValueCache`."""

    layout = CacheLayout(
        pos_axis=2, heads_axis=1, rotary="post", hook_prefix="model.layers.{layer}.kv_cache"
    )
    cache_class_name = "HFKeyValueCache"
    keeps_mask = False

    def shape(self, cache: Any, what: str) -> CacheShape:
        if not cache.layers:
            raise CacheShapeError(
                f"{what} holds no layers (an empty HFKeyValueCache()); pass a prefix from "
                "prefill(model, tokens) or a cache a forward pass filled"
            )
        slid = [layer.layer for layer in cache.layers if layer.evicted]
        if slid:
            raise CacheShapeError(
                f"{what}: sliding-window layers {slid} hold only their window (a cache made "
                "with HFKeyValueCache(config=...), as DynamicCache holds it), and safelens' "
                "experiments read every position; make the prefix with prefill(model, tokens)"
            )
        shapes = set()
        for layer in cache.layers:
            for name in ("keys", "values"):
                tensor = getattr(layer, name)
                if tensor is None:
                    raise CacheShapeError(
                        f"{what} layer {layer.layer} holds no {name} yet; every layer must "
                        "hold [batch, n_kv_heads, pos, d_head] tensors"
                    )
                shapes.add(tuple(tensor.shape))
        if len(shapes) != 1:
            raise CacheShapeError(
                f"{what} holds keys/values of several shapes {sorted(shapes)}; every layer "
                "must be one [batch, n_kv_heads, pos, d_head] shape"
            )
        batch, heads, length, d_head = shapes.pop()
        return CacheShape(len(cache.layers), batch, length, heads, d_head)

    def layer(self, cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        held = cache.layers[layer]
        return held.keys, held.values

    def stored_mask(self, cache: Any) -> torch.Tensor | None:
        return None

    def is_frozen(self, cache: Any) -> bool:
        return bool(cache.frozen)

    def replaced(self, cache: Any, layers: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Any:
        result = HFKeyValueCache(naming=cache.naming)
        for held in cache.layers:
            if held.layer in layers:
                keys, values = (t.transpose(1, 2).contiguous() for t in layers[held.layer])
                result.layers.append(
                    HFCacheLayer(held.layer, Sequence.of(keys), Sequence.of(values), cache.naming)
                )
            else:
                result.layers.append(held.derived(Sequence.fork))
        result.freeze()
        return result

    def cropped(self, cache: Any, length: int) -> Any:
        return cache.cropped(length)

    def length(self, cache: Any) -> int:
        return int(cache.get_seq_length())

    def batch_size(self, cache: Any) -> int:
        return max(int(cache.batch_size), 0)


HF_CACHE = HFCacheOps()


class _Sizes:
    """`config` without its dtype: the sizes `CacheDimensions.of` reads, and nothing else."""

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        if name in ("dtype", "torch_dtype"):
            raise AttributeError(name)
        return getattr(self._config, name)


def _context(config: Any) -> int | None:
    """The most positions the model can run: its learned position table's size, if any.

    A rotary model computes the angle of any position (HuggingFace runs prompts past its
    `max_position_embeddings`, e.g. under a rope scaling), so it has no bound here.
    """
    if any(
        getattr(config, name, None) for name in ("rope_parameters", "rope_scaling", "rope_theta")
    ):
        return None
    for name in ("n_ctx", "max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def pass_inputs(
    attention_mask: torch.Tensor, past: int, new: int
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`(attention_mask, position_ids)` for a pass of `new` tokens after `past` cached ones.

    Positions as `generate` gives them: the real tokens before each in its row
    (`attention_mask.cumsum(-1) - 1`, 0 on padding). An all-ones mask is dropped (no
    padding: attention is plain causal, as in `generate`), and its positions are
    `past, past + 1, …`.
    """
    if bool(attention_mask.all()):
        positions = torch.arange(past, past + new, device=attention_mask.device)
        return None, positions.expand(attention_mask.shape[0], new)
    counted = attention_mask.long().cumsum(-1) - 1
    return attention_mask, counted.masked_fill(attention_mask == 0, 0)[:, past:]


class HFBackend(Backend):
    """A HuggingFace causal LM (`PreTrainedModel` with `generate`), as the experiments see it."""

    family = "hf"
    clean_cache_call = "safelens.run_with_patching_cache(model, clean_tokens)"
    caches = HF_CACHE

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.config = model.config.get_text_config(decoder=True)
        family = getattr(self.config, "model_type", None) or "the model"
        check_cacheable(self.config, f"{family} ({type(model).__name__})")
        dims = CacheDimensions.of(_Sizes(self.config))
        self.n_layers, self.n_kv_heads, self.d_head = dims.n_layers, dims.n_kv_heads, dims.d_head
        # What `HFKeyValueCache(config=)` reads, without the config's dtype (the model's
        # parameters may have been cast since, and transformers warns on `torch_dtype`).
        self._sizes = SimpleNamespace(
            n_layers=self.n_layers,
            n_heads=self.n_kv_heads,
            n_key_value_heads=self.n_kv_heads,
            d_head=self.d_head,
        )
        output = model.get_output_embeddings()
        weight = getattr(output, "weight", None)
        self.d_vocab = int(weight.shape[0]) if weight is not None else self.config.vocab_size
        # The ids the input embedding has rows for, where it is a table (its own size).
        table = getattr(model.get_input_embeddings(), "weight", None)
        self._token_ids = int(table.shape[0]) if table is not None else self.d_vocab
        self.n_ctx = _context(self.config)
        self.d_model = int(self.config.hidden_size)
        self.device = model.device
        self.dtype = model.dtype

    @property
    def n_token_ids(self) -> int:
        return self._token_ids

    def check_model(self, what: str) -> None:
        hf_cache_argument(self.model)

    def bidirectional(self) -> str | None:
        flag = getattr(self.config, "use_bidirectional_attention", False)
        return f"config.use_bidirectional_attention={flag!r}" if flag else None

    # -- tokens -------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return getattr(self.model, "tokenizer", None)

    def to_tokens(self, text: str | list[str]) -> torch.Tensor:
        encoded = self.tokenizer(text, return_tensors="pt", padding=True, padding_side="left")
        tokens: torch.Tensor = encoded["input_ids"]
        return tokens

    def default_mask(self, tokens: torch.Tensor) -> torch.Tensor:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        if tokens.shape[0] > 1 and pad is not None:
            # Left padding: a row's leading pad tokens; a later pad id is a real token.
            mask = (tokens != pad).long().cummax(dim=-1).values
            if pad == getattr(self.tokenizer, "bos_token_id", None):
                # The last leading pad id is the BOS (GPT-2's pad = eos = bos), attended
                # as TransformerLens' `get_attention_mask` attends it.
                leading = (mask == 0).sum(dim=-1)
                rows = torch.nonzero(leading).squeeze(-1)
                mask[rows, leading[rows] - 1] = 1
            return mask
        return torch.ones_like(tokens, dtype=torch.long)

    # -- caches and passes ----------------------------------------------------------------

    def empty_cache(self, batch: int) -> HFKeyValueCache:
        return HFKeyValueCache(config=self._sizes)

    def check_cache(self, cache: Any, what: str) -> None:
        if not isinstance(cache, HFKeyValueCache):
            raise TypeError(
                f"{what}: a HuggingFace model reads a safelens HFKeyValueCache, got "
                f"{type(cache).__name__}; make the prefix with prefill(model, tokens)"
            )
        entries = [
            SimpleNamespace(
                layer=held.layer, keys=None if held.keys is None else held.keys.transpose(1, 2)
            )
            for held in cache.layers
        ]
        check_fits(entries, SimpleNamespace(**vars(self._sizes), dtype=self.dtype))  # type: ignore[arg-type]

    def _call(
        self,
        tokens: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: Any,
        last_only: bool = False,
    ) -> Any:
        """The model's logits for `tokens` after `cache`'s positions, `attention_mask` full.

        `last_only`: the last position's alone, `[batch, 1, d_vocab]`, where the forward
        takes `logits_to_keep` (as `generate`'s first pass), else every position's.
        """
        mask, positions = pass_inputs(attention_mask, HF_CACHE.length(cache), tokens.shape[1])
        kwargs: dict[str, Any] = {forward_cache_argument(self.model): cache}
        if last_only and "logits_to_keep" in forward_parameters(self.model):
            kwargs["logits_to_keep"] = 1
        output = self.model(
            input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs
        )
        return output.logits

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor, cache: Any) -> Any:
        return self._call(tokens, attention_mask, cache)

    def forward_last(self, tokens: torch.Tensor, attention_mask: torch.Tensor, cache: Any) -> Any:
        """`forward`'s logits at the last position, `[batch, d_vocab]`, the others not computed."""
        return self._call(tokens, attention_mask, cache, last_only=True)[:, -1]

    def forward_continuations(
        self, tokens: torch.Tensor, attention_mask: torch.Tensor, cache: Any
    ) -> Any:
        """A batch of right-padded continuations of the frozen, broadcast prefix `cache`.

        The one place continuations run on HuggingFace models (`score_continuations`):
        under [`shared_prefix`][safelens.shared_prefix], so attention reads the prefix
        once per layer rather than once per row.
        """
        with shared_prefix(self.model):
            return self._call(tokens, attention_mask, cache)

    def write_hook(self, layer: int, target: Literal["keys", "values"]) -> str:
        return HF_CACHE.layout.hook_name(layer, f"hook_{target[0]}_new")

    def layer_device(self, layer: int) -> torch.device:
        return layer_device(self, layer)  # a `device_map`'s

    def patch_site(self, activation: str, clean_cache: Any = None) -> Site:
        """The model's seams and cache hooks (`safelens.backends.hf._sites`)."""
        return hf_site(self, activation)

    def read_site(self, activation: str) -> Site:
        return hf_site(self, activation)

    def qk_sites(self) -> dict[str, Site]:
        roles = {"qk_q": "q", "qk_k": "k", "scores": "attn_scores", "pattern": "pattern"}
        return {role: hf_site(self, activation) for role, activation in roles.items()}

    @contextmanager
    def pass_hooks(self, cache: Any, fwd_hooks: FwdHooks) -> Iterator[None]:
        """Cache hooks on `cache`; module hooks act on this thread's passes only."""
        with attach_hooks(self, cache, fwd_hooks):
            yield

    # -- run_with_hooks --------------------------------------------------------------------

    def cache_hook_names(self) -> list[str]:
        points = ("hook_k_new", "hook_v_new", "hook_k_full", "hook_v_full")
        return [HF_CACHE.layout.hook_name(i, p) for i in range(self.n_layers) for p in points]

    def select_cache_hooks(self, names: NamesFilter) -> list[str]:
        return select_cache_hooks(self, names)

    def hooks(
        self, cache: Any, fwd_hooks: FwdHooks, reset_hooks_end: bool, clear_contexts: bool
    ) -> AbstractContextManager[Any]:
        return module_hooks(self, cache, fwd_hooks, reset_hooks_end, clear_contexts)

    def run(
        self,
        input: Any,
        cache: Any,
        fwd_hooks: FwdHooks,
        forward_args: dict[str, Any],
        reset_hooks_end: bool,
        clear_contexts: bool,
    ) -> Any:
        return run(self, input, cache, fwd_hooks, forward_args, reset_hooks_end, clear_contexts)

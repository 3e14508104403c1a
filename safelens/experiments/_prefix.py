"""A prompt prefix run once, frozen and shared: `Prefix` and `prefill`.

[`prefill`][safelens.prefill] runs a prefix through a model into a frozen cache of the
model's backend (`safelens.backends._backend`: a [`KeyValueCache`][safelens.KeyValueCache]
for a `HookedTransformer`, an [`HFKeyValueCache`][safelens.HFKeyValueCache] for a
HuggingFace causal LM) and returns a [`Prefix`][safelens.Prefix]: the cache plus what a
continuation needs from the prefix run (its tokens, attention mask, the logits at its
last position, and, where the backend can reuse it, the residual stream entering each
layer, which write-time ablations reuse). What continues a prefix (scoring
continuations, generating, ablating) checks it first with `check_prefix`: frozen,
self-consistent and made by the model it is given. The stored prefix is never written:
it stays frozen and bitwise unchanged.

Left padding: each real token sits at the position HuggingFace's `generate` gives it
(the number of real tokens before it in its row), so a left-padded row gives the numbers
of the same row unpadded.

`prefill` checks what it is given before anything runs: token ids (dtype, `0 <= id <
d_vocab`, at most `n_ctx` positions), the attention mask (0s and 1s, left-padded) and
its flag. A refused call changes nothing.

Caveat on memory: the kept residual stream takes `n_layers * batch * pos * d_model`
values, about as much as the cache; `keep_residuals=False` drops it when no write-time
ablation follows.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from jaxtyping import Float, Int

from ..backends._backend import Backend
from ..backends._cache_ops import cache_ops
from ..backends._families import backend_of
from ..backends._supported import SupportedModel
from ..core._arguments import flag, integer
from ..core._errors import CacheConfigError, CacheShapeError, FrozenCacheError, TokenError
from ..core._repr import summary_repr
from ..core._tokens import check_tokens

__all__ = ["Prefix", "check_prefix", "prefill", "runner_of", "token_limits"]


def token_limits(backend: Backend) -> SimpleNamespace:
    """What `check_tokens` bounds token ids by: the ids the model embeds, and `n_ctx`.

    `d_logits` is the width of the logits, which bounds the ids a continuation scores.
    """
    return SimpleNamespace(
        d_vocab=backend.n_token_ids, n_ctx=backend.n_ctx, d_logits=backend.d_vocab
    )


@dataclass(frozen=True, repr=False)
class Prefix:
    """A prefix run once: its frozen cache and what continuations need from it.

    **Fields:**

    - `cache`: the prefix's keys and values, frozen: a
      [`KeyValueCache`][safelens.KeyValueCache] or an
      [`HFKeyValueCache`][safelens.HFKeyValueCache].
    - `tokens`: `[batch, pos]` the prefix tokens (left padding included).
    - `attention_mask`: `[batch, pos]`, 0 on left padding.
    - `last_logits`: `[batch, d_vocab]` logits at the last position: the prediction of a
      continuation's first token.
    - `residuals`: the residual stream entering each layer (`blocks.{l}.hook_resid_pre`),
      `[batch, pos, d_model]` each, or `None` when not kept (or the backend cannot
      reuse them).
    """

    __repr__ = summary_repr  # tensors by shape, not by value

    cache: Any
    tokens: Int[torch.Tensor, "batch pos"]
    attention_mask: Int[torch.Tensor, "batch pos"]
    last_logits: Float[torch.Tensor, "batch d_vocab"]
    residuals: tuple[Float[torch.Tensor, "batch pos d_model"], ...] | None = None

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Check the parts agree: a frozen cache of `[batch, pos]`, tensors to match.

        Runs when a `Prefix` is made, and again where one is used (its cache may have
        been unfrozen or appended to since).

        **Raises:** `TypeError` for a part of the wrong type;
        [`TokenError`][safelens.TokenError] for tokens that are not integer
        `[batch, pos]`; [`CacheShapeError`][safelens.CacheShapeError] for parts whose
        shapes disagree; [`FrozenCacheError`][safelens.FrozenCacheError] for a cache that
        is not frozen.
        """
        tensors = [self.tokens, self.attention_mask, self.last_logits, *(self.residuals or ())]
        try:
            ops = cache_ops(self.cache, "Prefix.cache")
        except TypeError:
            ops = None
        if ops is None or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise TypeError(
                "a Prefix holds a KeyValueCache and tensors (tokens, attention_mask, "
                "last_logits, residuals), or an HFKeyValueCache and those tensors; got "
                f"{[type(t).__name__ for t in [self.cache, *tensors]]}"
            )
        batch, pos = check_tokens(self.tokens, None, "Prefix.tokens").shape
        shape = ops.shape(self.cache, "Prefix.cache")
        mask_shape: Any = getattr(ops.stored_mask(self.cache), "shape", ())
        parts: list[tuple[str, Any, dict[str, int | None]]] = [
            ("attention_mask", self.attention_mask.shape, {"batch": batch, "pos": pos}),
            ("last_logits", self.last_logits.shape, {"batch": batch, "d_vocab": None}),
            ("cache", (shape.batch, shape.length), {"batch": batch, "pos_so_far": pos}),
            *(
                (f"residuals[{i}]", resid.shape, {"batch": batch, "pos": pos, "d_model": None})
                for i, resid in enumerate(self.residuals or ())
            ),
        ]
        if ops.keeps_mask:
            parts.insert(3, ("cache.previous_attention_mask", mask_shape, parts[2][2]))
        for name, shape, expected in parts:
            sizes = list(expected.values())
            if len(shape) != len(sizes) or any(
                size not in (None, got) for got, size in zip(shape, sizes, strict=True)
            ):
                named = ", ".join(k if v is None else f"{k}={v}" for k, v in expected.items())
                raise CacheShapeError(
                    f"Prefix.{name} has shape {tuple(shape)}; expected [{named}] to match the "
                    f"prefix tokens [batch={batch}, pos={pos}]. The parts of a Prefix must come "
                    "from one run: make prefixes with prefill(model, tokens)"
                )
        if not ops.is_frozen(self.cache):
            raise FrozenCacheError(
                "Prefix.cache is not frozen, so a forward pass could store into the shared "
                "prefix; call prefix.cache.freeze() (prefill returns it frozen)"
            )

    @property
    def batch_size(self) -> int:
        """Rows of the prefix."""
        return int(self.tokens.shape[0])

    @property
    def length(self) -> int:
        """Positions of the prefix, left padding included."""
        return int(self.tokens.shape[1])

    def select(self, row: int) -> Prefix:
        """Row `row` as a batch-1 prefix (its cache in storage of its own, frozen).

        ```python
        >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
        >>> model = HookedTransformer(HookedTransformerConfig(n_layers=1, d_model=16, n_ctx=32, d_head=8, d_vocab=20, act_fn="gelu"))
        >>> mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
        >>> prefix = prefill(model, torch.tensor([[0, 5, 6], [4, 5, 6]]), attention_mask=mask)
        >>> prefix.select(0).attention_mask, prefix.select(0).cache.batch_size
        (tensor([[0, 1, 1]]), 1)

        ```
        """
        integer(row, "row")
        if not -self.batch_size <= row < self.batch_size:
            raise IndexError(f"row {row} is out of range for a prefix of batch {self.batch_size}")
        cache = self.cache.select([row])
        cache.freeze()
        rows = slice(row, row + 1) if row != -1 else slice(-1, None)
        residuals = None if self.residuals is None else tuple(r[rows] for r in self.residuals)
        return Prefix(
            cache,
            self.tokens[rows],
            self.attention_mask[rows],
            self.last_logits[rows],
            residuals,
        )


def _prefix_tokens(backend: Backend, tokens_or_text: Any) -> torch.Tensor:
    name = "tokens_or_text"
    if isinstance(tokens_or_text, str) or (
        isinstance(tokens_or_text, list) and any(isinstance(t, str) for t in tokens_or_text)
    ):
        if not isinstance(tokens_or_text, str) and not all(
            isinstance(t, str) for t in tokens_or_text
        ):
            raise TypeError(f"{name} mixes text and token ids; pass a list of str or of ints")
        if backend.tokenizer is None:
            raise ValueError(
                f"{name} is text but the model has no tokenizer; pass token ids "
                "(a [batch, pos] tensor) and an attention_mask instead"
            )
        tokens_or_text = backend.to_tokens(tokens_or_text)
    tokens = check_tokens(tokens_or_text, token_limits(backend), name, rank=None)
    if tokens.dim() == 1:
        tokens = tokens[None]
    if tokens.dim() != 2 or tokens.shape[0] == 0:
        raise TokenError(
            f"{name} must be token ids [batch, pos] (or [pos]) with batch >= 1, got shape "
            f"{tuple(tokens.shape)}"
        )
    return tokens


def _prefix_mask(backend: Backend, tokens: torch.Tensor, attention_mask: Any) -> torch.Tensor:
    if attention_mask is None:
        return backend.default_mask(tokens)
    try:
        mask = torch.as_tensor(attention_mask, device=tokens.device)
    except (TypeError, ValueError, RuntimeError):
        raise CacheShapeError(
            f"attention_mask must be a [batch, pos] tensor of 0s and 1s, got "
            f"{type(attention_mask).__name__}"
        ) from None
    if mask.shape != tokens.shape:
        raise CacheShapeError(
            f"attention_mask of shape {tuple(mask.shape)} does not fit the tokens "
            f"[batch={tokens.shape[0]}, pos={tokens.shape[1]}]"
        )
    if mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
        raise CacheShapeError(
            f"attention_mask must hold only 0 (padding) and 1 (real token), got values "
            f"{torch.unique(mask).tolist()[:8]} of {mask.dtype}"
        )
    mask = mask.long()
    if not bool((mask[:, -1] == 1).all()):
        raise CacheShapeError(
            "attention_mask has padding at the last position of some row; a prefix must be "
            "left-padded (padding first) so that continuations follow its real tokens"
        )
    return mask


def prefill(
    model: SupportedModel,
    tokens_or_text: Int[torch.Tensor, "batch pos"] | str | list[str] | list[int],
    attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
    keep_residuals: bool = True,
) -> Prefix:
    """Run a prefix through `model` once into a frozen cache, ready to share.

    Safe from threads: the residuals are kept by hooks that act on this call's forward
    pass alone, so other threads' passes through `model` meanwhile are neither captured
    nor changed.

    **Arguments:**

    - `model`: a TransformerLens `HookedTransformer`, a TransformerBridge or a
      HuggingFace causal LM (a bridge with no hook attached runs the pass on its
      plain HuggingFace model where one pass of the last token there gives the
      bridge's logits).
    - `tokens_or_text`: `[batch, pos]` (or `[pos]`) token ids, or text when the model
      has a tokenizer.
    - `attention_mask`: `[batch, pos]`, 0 on left padding; all ones when omitted
      (TransformerLens' own mask from the tokenizer for a batch of text).
    - `keep_residuals`: keep the residual stream entering each layer, so that
      [`ablate_write`][safelens.ablate_write] skips the layers before the edit (memory:
      `n_layers * batch * pos * d_model` values, about as much as the cache). Only
      where the backend reuses residuals (`HookedTransformer`); elsewhere none are kept.

    **Returns:** a [`Prefix`][safelens.Prefix] whose cache is frozen: a
    [`KeyValueCache`][safelens.KeyValueCache] on a `HookedTransformer`, an
    [`HFKeyValueCache`][safelens.HFKeyValueCache] on a HuggingFace model.

    **Raises:** `ValueError` for text without a tokenizer;
    [`TokenError`][safelens.TokenError] for tokens that are not integer ids in
    `[0, d_vocab)` of at most `n_ctx` positions;
    [`CacheShapeError`][safelens.CacheShapeError] for a mask of the wrong shape or
    values, or a right-padded mask; `TypeError` for a model or `keep_residuals` of the
    wrong type; [`CacheConfigError`][safelens.CacheConfigError] for a model whose
    attention reads later positions (`attention_dir="bidirectional"`,
    `use_bidirectional_attention=True`), whose prefix no continuation can reuse.

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> model = HookedTransformer(HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=32, d_head=8, d_vocab=20, act_fn="gelu"))
    >>> prefix = prefill(model, torch.tensor([[1, 2, 3, 4]]))
    >>> prefix.cache.sequence_length, bool(prefix.cache.frozen), prefix.last_logits.shape
    (4, True, torch.Size([1, 20]))

    ```
    """
    backend = backend_of(model, "prefill")
    _check_causal(backend, "prefill")
    tokens = _prefix_tokens(backend, tokens_or_text).to(backend.device)
    mask = _prefix_mask(backend, tokens, attention_mask)
    flag(keep_residuals, "keep_residuals")
    cache = backend.empty_cache(tokens.shape[0])
    residuals: dict[int, torch.Tensor] = {}

    def keeper(layer: int) -> Any:
        def keep(resid: torch.Tensor, hook: Any) -> None:
            residuals[layer] = resid

        return keep

    keep = keep_residuals and backend.reuses_residuals
    layers = range(backend.n_layers) if keep else range(0)
    hooks = [(backend.residual_hook(i), keeper(i)) for i in layers]
    on_twin = None if hooks else _on_twin(backend, tokens, mask)
    if on_twin is not None:
        return Prefix(on_twin[0], tokens, mask, on_twin[1])
    with torch.no_grad(), backend.pass_hooks(cache, hooks):
        last = backend.forward_last(tokens, mask, cache)
    cache.freeze()
    kept = tuple(residuals[i] for i in layers) if keep else None
    return Prefix(cache, tokens, mask, last, kept)


def _on_twin(
    backend: Backend, tokens: torch.Tensor, mask: torch.Tensor
) -> tuple[Any, torch.Tensor] | None:
    """`prefill`'s frozen cache and last logits from `backend`'s twin (`Backend.twin`), or
    `None`: no twin, or one that fails or does not give `backend`'s numbers (no hook of
    the user's is attached, so a failure is the twin's own)."""
    twin = backend.twin()
    if twin is backend:
        return None
    cache = backend.empty_cache(tokens.shape[0])
    try:
        with torch.no_grad():
            last = twin.forward_last(tokens, mask, cache)
    except Exception:  # noqa: BLE001 - the pass runs on the bridge instead
        return None
    cache.freeze()
    return (cache, last) if _same_numbers(backend, twin, cache, tokens, mask) else None


def _same_numbers(
    backend: Backend, twin: Backend, cache: Any, tokens: torch.Tensor, mask: torch.Tensor
) -> bool:
    with torch.no_grad():
        return backend.same_numbers(twin, cache, tokens, mask)


def runner_of(backend: Backend, prefix: Prefix) -> Backend:
    """The backend to run `prefix`'s continuations on: `backend`'s twin where it gives
    `backend`'s numbers on the prefix's last position, else `backend` (no hook attached)."""
    twin = backend.twin()
    same = _same_numbers(backend, twin, prefix.cache, prefix.tokens, prefix.attention_mask)
    return twin if same else backend


def check_prefix(model: Any, prefix: Prefix, what: str) -> Backend:
    """Check `prefix` is a sound `Prefix` made by `model`; return `model`'s backend.

    **Raises:** `TypeError` for a model or prefix of the wrong type; what
    [`Prefix.check`][safelens.Prefix.check] raises; and
    [`CacheConfigError`][safelens.CacheConfigError] when the prefix was made by another
    model (its cache or logits do not fit `model`), or `model`'s attention reads later
    positions.
    """
    backend = backend_of(model, what)
    _check_causal(backend, what)
    if not isinstance(prefix, Prefix):
        raise TypeError(
            f"{what} needs a Prefix (from safelens.prefill), got {type(prefix).__name__}; "
            "prefill(model, tokens) returns the cache together with the prefix's last logits"
        )
    prefix.check()
    try:
        backend.check_cache(prefix.cache, what)
        if prefix.last_logits.shape[-1] != backend.d_vocab:
            raise CacheConfigError(
                f"last_logits: cfg expects d_vocab_out={backend.d_vocab}, prefix has "
                f"{prefix.last_logits.shape[-1]}"
            )
    except CacheConfigError as error:
        raise CacheConfigError(
            f"{what}: the prefix was made by another model; {error}. Run "
            "prefill(model, tokens) with the model you continue it with"
        ) from None
    return backend


def _check_causal(backend: Backend, what: str) -> None:
    """Refuse a model whose attention reads later positions: no prefix of it can be reused."""
    why = backend.bidirectional()
    if why is not None:
        raise CacheConfigError(
            f"{what}: this model's attention reads later positions ({why}), so each "
            "position's keys and values depend on the tokens after it, and a cached prefix "
            "cannot give an uncached run's numbers for what follows it; run the whole "
            "sequence in one forward pass instead"
        )

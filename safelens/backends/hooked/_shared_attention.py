"""Attention that reads a shared prefix once per layer: `shared_prefix_attention`.

TransformerLens' attention joins the cached keys with the new ones and, on rotary
models, rotates the whole joined sequence, for every row of the batch, in every layer.
When many rows continue one prefix (`cache.expand(n)`), that is `n` copies of the same
work, and it dominates a short continuation of a long prefix. Inside
`with shared_prefix_attention(model):`, an attention layer given a frozen safelens
entry reads each stored piece that is broadcast from one row (what `expand` makes)
once: it rotates that piece's keys once, scores every row's queries against them in one
matmul and mixes its values in another. Pieces held per row, and the new tokens, are
read per row as before. Nothing is joined, copied or stored.

Hooks: `hook_q`, `hook_k`, `hook_v`, `hook_rot_q`, `hook_attn_scores`, `hook_pattern`
and `hook_z` fire with TransformerLens' shapes, and so do a cache's `hook_k_new` and
`hook_v_new`. A hook on `hook_q` may keep only the last queries (`q[:, -k:]`): the
layer then computes attention, and returns outputs, for those positions alone. Hooks on `hook_rot_k`, or on a cache's `hook_k_full`/`hook_v_full`, see
the joined keys, so a layer with any of them runs TransformerLens' own forward.

Caveat: the numbers are TransformerLens' to float rounding, not bitwise (each matmul
is split by piece). A layer falls back to TransformerLens' own forward whenever this
path would not reproduce it: an unfrozen cache, no cache, those hooks, ALiBi or
relative position biases, local or bidirectional attention, attention sinks,
soft-capped scores, `use_attn_result`, QK clipping or norms applied in the forward,
dynamic NTK rotary, multi-device models, or an attention class of its own.

Threads: the readers are installed on the model's attention modules (their `forward`
attribute) by the first thread that enters the block and removed by the last one that
leaves, which restores exactly the attribute state found; in between, a reader does its
work only for calls from a thread inside the block, and hands any other thread's call
to the layer's own forward, unchanged. So threads may score continuations of one frozen
prefix on one model at once, next to threads running plain forwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from transformer_lens.components import Attention, GroupedQueryAttention
from transformer_lens.utilities.activation_functions import softcap_enabled

from ...core._cache_entry import KeyValueCacheEntry
from ...core._thread_hooks import hooked_here, suspended

if TYPE_CHECKING:
    from transformer_lens import HookedTransformer

__all__ = ["shared_inputs", "shared_prefix_attention"]

_POSITIONS = ("standard", "rotary", "shortformer")
_NORMED_IN_FORWARD = ("OlmoeForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM")


def supports(attn: Any) -> bool:
    """Whether this layer's forward is one `_SharedReader` reproduces."""
    cfg = attn.cfg
    return (
        type(attn) in (Attention, GroupedQueryAttention)
        and cfg.positional_embedding_type in _POSITIONS
        and (attn._attention_dir_override or cfg.attention_dir) == "causal"
        and attn.attn_type == "global"
        and cfg.original_architecture not in _NORMED_IN_FORWARD
        and cfg.clip_qkv is None
        and not cfg.use_logn_attn
        and not cfg.use_attention_sinks
        and not softcap_enabled(cfg.attn_scores_soft_cap)
        and not cfg.use_attn_result
        and not cfg.load_in_4bit
        and not cfg.use_dynamic_ntk_rope
        and cfg.n_devices == 1
    )


def _thread_hooks_only(point: Any) -> bool:
    """Whether `point`'s only hooks are `thread_hooks`' (which `suspended` silences)."""
    hooks = (*tuple(point._forward_hooks.values()), *tuple(point._forward_pre_hooks.values()))
    return all(hasattr(hook, "thread") for hook in hooks)


def _repeated(x: torch.Tensor, first: int, copies: int) -> torch.Tensor:
    """`x`'s rows before `first`, then `copies` copies of the rest, written once."""
    rows = x.shape[0] - first
    out = x.new_empty((first + copies * rows, *x.shape[1:]))
    out[:first] = x[:first]
    out[first:].unflatten(0, (copies, rows)).copy_(x[first:].expand(copies, *x[first:].shape))
    return out


def _same_rows(mask: Int[torch.Tensor, "batch pos"]) -> bool:
    return bool((mask == mask[:1]).all())


class _Installed:
    """The readers installed on one model, how many blocks hold them, and who is inside."""

    def __init__(self) -> None:
        self.holders = 0
        self.replaced: list[tuple[Any, Any]] = []
        self._depth = threading.local()

    def inside(self) -> bool:
        """Whether the calling thread is inside a `shared_prefix_attention` block."""
        return getattr(self._depth, "value", 0) > 0

    def enter(self) -> None:
        """Count the calling thread into one more block."""
        self._depth.value = getattr(self._depth, "value", 0) + 1

    def leave(self) -> None:
        """Count the calling thread out of its innermost block."""
        self._depth.value -= 1


# Models whose attention holds readers, by id (each is alive while a block holds it).
_INSTALLED: dict[int, _Installed] = {}
_INSTALLING = threading.Lock()
# Per thread: `(first, rows)` while its attention inputs repeat rows (`shared_inputs`).
_SHARED_INPUTS = threading.local()


class _SharedReader:
    """An attention forward that reads broadcast cache pieces once (see the module)."""

    def __init__(
        self, attn: Any, original: Callable[..., torch.Tensor], installed: _Installed
    ) -> None:
        self.attn = attn
        self.original = original
        self.installed = installed

    def __call__(
        self,
        query_input: torch.Tensor,
        key_input: torch.Tensor,
        value_input: torch.Tensor,
        past_kv_cache_entry: Any = None,
        additive_attention_mask: torch.Tensor | None = None,
        attention_mask: Int[torch.Tensor, "batch offset_pos"] | None = None,
        position_bias: torch.Tensor | None = None,
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        attn = self.attn
        rotary = attn.cfg.positional_embedding_type == "rotary"
        if (
            not self.installed.inside()
            or not isinstance(past_kv_cache_entry, KeyValueCacheEntry)
            or not past_kv_cache_entry.reads_in_pieces
            or additive_attention_mask is not None
            or position_bias is not None
            or (rotary and hooked_here(attn.hook_rot_k))
        ):
            return self.original(
                query_input=query_input,
                key_input=key_input,
                value_input=value_input,
                past_kv_cache_entry=past_kv_cache_entry,
                additive_attention_mask=additive_attention_mask,
                attention_mask=attention_mask,
                position_bias=position_bias,
            )
        q, k, v = self._qkv(query_input, key_input, value_input)
        key_pieces, value_pieces = past_kv_cache_entry.frozen_pieces(k, v)
        # The queries are the last positions: all new ones, or fewer if hook_q kept fewer.
        offset = sum(piece.shape[1] for piece in key_pieces) - q.shape[1]
        if rotary:
            q = attn.hook_rot_q(attn.apply_rotary(q, offset, attention_mask))
        pieces = self._pieces(key_pieces, value_pieces, attention_mask, rotary)
        scores = torch.cat([self._scores(q, key, shared) for key, _, shared in pieces], dim=-1)
        scores = attn.apply_causal_mask(scores / attn.attn_scale, offset, attention_mask)
        pattern = F.softmax(attn.hook_attn_scores(scores), dim=-1)
        # TransformerLens zeroes NaN rows (every key masked); softmax yields no infinity.
        pattern = pattern.nan_to_num(nan=0.0)
        pattern = attn.hook_pattern(pattern).to(dtype=v.dtype)
        widths = [key.shape[1] for key, _, _ in pieces]
        z = sum(
            self._mixed(part, value, shared)
            for part, (_, value, shared) in zip(pattern.split(widths, dim=-1), pieces, strict=True)
        )
        assert isinstance(z, torch.Tensor)
        z = attn.hook_z(z.reshape(q.shape))
        w = einops.rearrange(attn.W_O, "n_heads d_head d_model -> d_model (n_heads d_head)")
        return F.linear(z.reshape(*z.shape[:2], -1).to(w.dtype), w.contiguous(), attn.b_O)

    def _qkv(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values; the repeated rows of `shared_inputs` mapped once."""
        attn = self.attn
        shared = getattr(_SHARED_INPUTS, "rows", None)
        points = (attn.hook_q, attn.hook_k, attn.hook_v)
        if shared is None or attn.cfg.use_qk_norm or not all(map(_thread_hooks_only, points)):
            return attn.calculate_qkv_matrices(*inputs)
        first, rows = shared
        copies = (inputs[0].shape[0] - first) // rows
        if copies < 2 or any(x.shape[0] != first + copies * rows for x in inputs):
            return attn.calculate_qkv_matrices(*inputs)
        with suspended():  # the hooks see the rows once, repeated
            mapped = attn.calculate_qkv_matrices(*(x[: first + rows] for x in inputs))
        q, k, v = (
            point(_repeated(x, first, copies)) for point, x in zip(points, mapped, strict=True)
        )
        return q, k, v

    def _pieces(
        self,
        key_pieces: tuple[torch.Tensor, ...],
        value_pieces: tuple[torch.Tensor, ...],
        mask: torch.Tensor | None,
        rotary: bool,
    ) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
        """Each piece's (rotated) keys and values, one row of them when broadcast."""
        out = []
        start = 0
        for key, value in zip(key_pieces, value_pieces, strict=True):
            end = start + key.shape[1]
            broadcast = key.stride(0) == 0 and value.stride(0) == 0
            same_mask = mask is None or _same_rows(mask[:, :end])
            shared = key.shape[0] == 1 or (broadcast and same_mask)
            if shared:
                key, value = key[:1], value[:1]
            if rotary:
                rows = mask if mask is None else mask[: key.shape[0], :end]
                key = self.attn.apply_rotary(key, start, rows)
            out.append((key, value, shared))
            start = end
        return out

    @staticmethod
    def _scores(
        q: Float[torch.Tensor, "batch pos n_heads d_head"],
        key: Float[torch.Tensor, "batch key_pos n_kv_heads d_head"],
        shared: bool,
    ) -> Float[torch.Tensor, "batch n_heads pos key_pos"]:
        batch, pos, n_heads, d_head = q.shape
        kv_heads, length = key.shape[2], key.shape[1]
        grouped = q.reshape(batch, pos, kv_heads, n_heads // kv_heads, d_head)
        if shared:
            lhs = grouped.permute(2, 0, 3, 1, 4).reshape(kv_heads, -1, d_head)
            out = lhs @ key[0].permute(1, 2, 0)
            out = out.reshape(kv_heads, batch, -1, pos, length).transpose(0, 1)
        else:
            lhs = grouped.permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, -1, d_head)
            out = lhs @ key.permute(0, 2, 3, 1)
        return out.reshape(batch, n_heads, pos, length)

    @staticmethod
    def _mixed(
        pattern: Float[torch.Tensor, "batch n_heads pos key_pos"],
        value: Float[torch.Tensor, "batch key_pos n_kv_heads d_head"],
        shared: bool,
    ) -> Float[torch.Tensor, "batch pos n_kv_heads group d_head"]:
        batch, n_heads, pos, length = pattern.shape
        kv_heads = value.shape[2]
        grouped = pattern.reshape(batch, kv_heads, -1, pos, length)
        if shared:
            lhs = grouped.transpose(0, 1).reshape(kv_heads, -1, length)
            out = (lhs @ value[0].transpose(0, 1)).reshape(kv_heads, batch, -1, pos, value.shape[3])
            return out.permute(1, 3, 0, 2, 4)
        out = grouped.reshape(batch, kv_heads, -1, length) @ value.transpose(1, 2)
        return out.reshape(batch, kv_heads, -1, pos, value.shape[3]).permute(0, 3, 1, 2, 4)


@contextmanager
def shared_inputs(first: int, rows: int) -> Iterator[None]:
    """Within the block, this thread's attention inputs repeat rows `first:first + rows`.

    From row `first` on, an attention input given to a layer that reads its cache in
    pieces is copies of its rows `first:first + rows` (the runs entering a patching
    sweep's layer, `safelens.patching._skips`' shared inputs): the layer maps those rows
    to queries, keys and values once and repeats them; `hook_q`, `hook_k` and `hook_v`
    then fire once, on every row. Not taken where the layer normalises queries and keys
    (after those hooks) or a hook other than `thread_hooks`' sits on them (a hook of
    TransformerLens' list, a plain PyTorch hook or pre-hook).
    """
    before = getattr(_SHARED_INPUTS, "rows", None)
    _SHARED_INPUTS.rows = (first, rows)
    try:
        yield
    finally:
        _SHARED_INPUTS.rows = before


@contextmanager
def shared_prefix_attention(model: HookedTransformer) -> Iterator[None]:
    """Within the block, `model`'s attention reads broadcast prefixes once per layer.

    Use it around forward passes on a frozen cache expanded from one prefix
    (`prefix.expand(n)`): the prefix's keys are rotated once and scored against every
    row in one matmul, instead of being copied and rotated once per row. The numbers
    equal TransformerLens' attention to float rounding; layers or calls it cannot
    reproduce exactly run TransformerLens' own forward (see the module notes).
    [`score_continuations`][safelens.score_continuations] and the patching sweeps use it.

    Safe from threads: the block changes only calls made by the thread inside it (other
    threads' forwards on the same model run TransformerLens' own attention), and when
    the last thread leaves, the attention modules are exactly as they were, even if a
    block raised.

    **Arguments:**

    - `model`: a TransformerLens `HookedTransformer`.

    **Raises:** `TypeError` when `model` has no attention blocks.

    ```python
    >>> from transformer_lens import HookedTransformer, HookedTransformerConfig
    >>> from safelens import KeyValueCache
    >>> model = HookedTransformer(HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=32, d_head=8, d_vocab=20, act_fn="gelu", positional_embedding_type="rotary"))
    >>> prefix = KeyValueCache.init_cache(model.cfg, "cpu")
    >>> _ = model(torch.tensor([[1, 2, 3, 4]]), attention_mask=torch.ones(1, 4), past_kv_cache=prefix)
    >>> rows = prefix.expand(3)
    >>> rows.freeze()
    >>> with shared_prefix_attention(model):
    ...     logits = model(torch.tensor([[5], [6], [7]]), attention_mask=torch.ones(3, 1), past_kv_cache=rows)
    >>> logits.shape
    torch.Size([3, 1, 20])

    ```
    """
    blocks = getattr(model, "blocks", None)
    if blocks is None or not all(hasattr(block, "attn") for block in blocks):
        raise TypeError(
            f"model must be a HookedTransformer with attention blocks, got {type(model).__name__}"
        )
    installed = _hold(model, blocks)
    try:
        installed.enter()
        try:
            yield
        finally:
            installed.leave()
    finally:
        _release(model, installed)


def _hold(model: Any, blocks: Any) -> _Installed:
    """Install the readers on `model` unless another block already has; count this one."""
    with _INSTALLING:
        installed = _INSTALLED.get(id(model))
        if installed is None:
            installed = _Installed()
            try:
                for block in blocks:
                    attn = block.attn
                    if supports(attn):
                        previous = attn.__dict__.get("forward")
                        attn.forward = _SharedReader(attn, attn.forward, installed)
                        installed.replaced.append((attn, previous))
            except BaseException:
                _uninstall(installed)
                raise
            _INSTALLED[id(model)] = installed
        installed.holders += 1
        return installed


def _release(model: Any, installed: _Installed) -> None:
    """Count this block out; the last one out restores every `forward` it found."""
    with _INSTALLING:
        installed.holders -= 1
        if installed.holders == 0:
            del _INSTALLED[id(model)]
            _uninstall(installed)


def _uninstall(installed: _Installed) -> None:
    for attn, previous in reversed(installed.replaced):
        if previous is None:
            del attn.forward
        else:
            attn.forward = previous
    installed.replaced.clear()

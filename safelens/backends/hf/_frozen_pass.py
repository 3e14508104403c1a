"""What refuses a multi-step loop over a frozen `HFKeyValueCache`: `FrozenPasses`.

A frozen cache stores nothing, so a pass over it reads what it holds plus the pass's own
tokens. That is right for any pass whose positions continue what the cache holds:
scoring many continuations of one frozen prefix, each starting right after it, or the
same continuation twice. It is silently wrong for a loop that feeds each step's token
alone and believes the step before was stored (`generate`, greedy or sampled): from the
second step on, attention misses the earlier steps' keys. Two signals reach the cache:

- **The pass's positions.** transformers >= 5.24 hands `cache.update` the pass's
  `position_ids` (`kwargs=`), and older callers may pass `cache_position`
  (`cache_kwargs`). A frozen cache seeing `P` positions refuses a pass whose first
  position is past `P`: the caller counts positions the cache never stored. A
  left-padded row starts lower (`position_ids` skip its padding), which is allowed.
- **`generate` itself.** transformers' `generate` marks a cache it is handed
  (`cache._is_user_defined = True`) before its first step, under every version; it stores
  every step it decodes, so a frozen cache refuses the mark, and `generate` fails before
  it runs anything (beam search and assisted decoding included, through nnsight's
  `LanguageModel.generate` and a bridge's `hf_generate` as well).

Caveat: a pass that passes no positions gets them from `cache.get_seq_length()`, so it
always continues what the cache holds; a hand-written loop over a frozen cache then
forgets each step, as TransformerLens' frozen cache does. On transformers < 5.24 explicit
`position_ids` do not reach the cache: only `generate`'s mark does. A traced pass
(`torch.export`, `torch.compile`) is not checked: its positions are not numbers yet.
"""

from __future__ import annotations

from typing import Any

import torch

from ...core._errors import FrozenCacheError

__all__ = ["FrozenPasses", "refuse_generate"]


def refuse_generate() -> FrozenCacheError:
    """The error for `generate` handed a frozen cache."""
    return FrozenCacheError(
        "generate was handed a frozen cache: generate stores every step it decodes and a "
        "frozen cache stores none, so from the second step on attention would miss the "
        "earlier steps' keys. Pass cache.fork() (a branch that shares the prefix and "
        "stores the steps) instead"
    )


def _positions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The pass's `cache_position` (1-D) or `position_ids`, as HuggingFace attention passed them."""
    for given in (kwargs.get("kwargs"), kwargs.get("cache_kwargs"), *args[:1]):
        if isinstance(given, dict):
            for name in ("cache_position", "position_ids"):
                positions = given.get(name)
                if isinstance(positions, torch.Tensor) and positions.numel():
                    return positions
    return None


class FrozenPasses:
    """Checks that each pass over a frozen cache continues what the cache holds.

    The check reads the positions once per pass (HuggingFace hands every layer the same
    tensor), so a pass on an accelerator synchronises once, not once per layer.
    """

    __slots__ = ("_checked",)

    def __init__(self) -> None:
        self._checked: tuple[torch.Tensor, int] | None = None

    def check(self, held: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Refuse a pass whose positions start past the `held` positions a frozen cache saw.

        **Raises:** [`FrozenCacheError`][safelens.FrozenCacheError] naming both.
        """
        positions = _positions(args, kwargs)
        # Traced (torch.export, torch.compile), a position is no number to compare.
        if positions is None or torch.compiler.is_compiling():
            return
        checked = self._checked
        if checked is not None and checked[0] is positions and checked[1] == held:
            return
        # A row's first position: `cache_position` is 1-D, `position_ids` `[..., pos]`.
        start = int(positions[..., 0].max())
        if start > held:
            raise FrozenCacheError(
                f"a pass at positions from {start} reached a frozen cache holding {held} "
                f"positions: the caller counts {start - held} position(s) as stored that a "
                "frozen cache never stores (a multi-step loop such as generate), so "
                "attention would miss their keys. Run multi-step loops on cache.fork(), "
                "which shares the prefix and stores the steps"
            )
        self._checked = (positions, held)

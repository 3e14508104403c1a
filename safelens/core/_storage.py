"""Growing, shareable storage for one cached tensor (keys, values or attention mask).

A `Sequence` holds a tensor that grows along axis 1 (`pos`). It is made of read-only
shared *segments* (a prefix it branched from) followed by its own *buffer*, which has
spare capacity so that appending a token writes in place: amortised O(1) per token
instead of TransformerLens' copy of the whole cache per token.

Sharing is copy-on-write. Many sequences may point at one buffer, but only the one whose
end is the buffer's high-water mark (`filled`) may write past it; any other sequence that
appends starts a buffer of its own and keeps the shared part as a segment. The mark never
goes down, not even on [`restore`][], so memory once handed out is never written again: a
tensor handed out by [`view`][] keeps its values, a branch never sees its parent's later
tokens, and the parent never sees the branch's.

Gradients: when autograd would record an append (grad enabled and the new or the stored
tensor requires grad), the append is out of place, a fresh `torch.cat` as in
TransformerLens' cache, so every tensor handed out stays valid for `backward()`. Otherwise
the write past the mark goes through `Tensor.data`, which autograd's version counter does
not see: it changes no memory any handed-out tensor shows, so a view saved for backward by
some other operation (say, attention with trainable queries) stays valid too.

Caveat: once a sequence grows past its first append, the spare capacity costs up to 2x
the filled memory; with gradients recorded, each append copies the sequence's own part.
"""

from __future__ import annotations

import torch

__all__ = ["Sequence"]

_POS = 1


def _nonempty(pieces: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(p for p in pieces if p.shape[_POS])


class _Buffer:
    """A tensor with spare room along `pos`; `filled` is how far anyone has written."""

    __slots__ = ("tensor", "filled")

    def __init__(self, tensor: torch.Tensor, filled: int) -> None:
        self.tensor = tensor
        self.filled = filled


class Sequence:
    """A tensor `[batch, pos, ...]` that grows along `pos`, sharing storage on branch."""

    __slots__ = ("_segments", "_buffer", "_used")

    def __init__(self, segments: tuple[torch.Tensor, ...], buffer: _Buffer, used: int) -> None:
        self._segments = segments
        self._buffer = buffer
        self._used = used

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Sequence:
        """A sequence holding `tensor` in a buffer of its own (no copy is made)."""
        return cls((), _Buffer(tensor, tensor.shape[_POS]), tensor.shape[_POS])

    def _own(self) -> torch.Tensor:
        return self._buffer.tensor.narrow(_POS, 0, self._used)

    def pieces(self) -> tuple[torch.Tensor, ...]:
        """The tensors that, joined along `pos`, make up this sequence."""
        if self._used or not self._segments:
            return self._segments + (self._own(),)
        return self._segments

    def view(self) -> torch.Tensor:
        """The filled part: a view when stored in one piece, else a fresh join."""
        pieces = self.pieces()
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=_POS)

    @property
    def length(self) -> int:
        return sum(s.shape[_POS] for s in self._segments) + self._used

    @property
    def template(self) -> torch.Tensor:
        """A tensor with this sequence's batch, trailing sizes, dtype and device."""
        return self._buffer.tensor

    def joined(self, new: torch.Tensor) -> torch.Tensor:
        """This sequence followed by `new`, without storing anything."""
        return torch.cat(self.pieces() + (new,), dim=_POS)

    def append_(self, new: torch.Tensor) -> torch.Tensor:
        """Store `new` after the filled part; return the whole.

        In place when the buffer has room past the mark and autograd records nothing;
        else into a new buffer (a `torch.cat` of the own part and `new` when it records).
        """
        count = new.shape[_POS]
        held = self._buffer.tensor
        end = self._used + count
        if torch.is_grad_enabled() and (new.requires_grad or held.requires_grad):
            self._buffer = _Buffer(torch.cat((self._own(), new), dim=_POS), end)
        elif self._used == self._buffer.filled and end <= held.shape[_POS]:
            held.data.narrow(_POS, self._used, count).copy_(new)
            self._buffer.filled = end
        else:
            shape = list(new.shape)
            # The first append (a prefill, or a continuation's first step) gets exactly
            # its size, so N branches of a prefix hold no spare room; later appends double.
            shape[_POS] = 2 * end if self._used else end
            data = new.new_empty(shape)
            data.narrow(_POS, 0, self._used).copy_(self._own())
            data.narrow(_POS, self._used, count).copy_(new)
            self._buffer = _Buffer(data, end)
        self._used = end
        return self.view()

    def snapshot(self) -> tuple[object, ...]:
        """What [`restore`][] needs to undo later appends."""
        return (self._segments, self._buffer, self._used)

    def restore(self, state: tuple[object, ...]) -> None:
        """Undo every append since `state` was taken.

        The buffer's high-water mark stays where those appends left it, so the next append
        starts a buffer of its own instead of overwriting what they handed out.
        """
        self._segments, self._buffer, self._used = state  # type: ignore[assignment]

    def fork(self) -> Sequence:
        """A branch sharing everything filled so far, with an empty buffer of its own."""
        own = self._buffer.tensor.narrow(_POS, 0, 0)
        return Sequence(_nonempty(self.pieces()), _Buffer(own, 0), 0)

    def expand(self, rows: int) -> Sequence:
        """Broadcast a batch-1 sequence to `rows` rows without copying it."""
        pieces = tuple(p.expand(rows, *p.shape[1:]) for p in self.pieces())
        return Sequence(_nonempty(pieces), _Buffer(pieces[0].narrow(_POS, 0, 0), 0), 0)

    def crop(self, length: int) -> Sequence:
        """The first `length` positions, sharing storage with this sequence."""
        kept: list[torch.Tensor] = []
        left = length
        for piece in self.pieces():
            if left <= 0:
                break
            take = min(left, piece.shape[_POS])
            kept.append(piece.narrow(_POS, 0, take))
            left -= take
        if not kept:
            return Sequence((), _Buffer(self._buffer.tensor.narrow(_POS, 0, 0), 0), 0)
        return Sequence(tuple(kept), _Buffer(kept[-1].narrow(_POS, 0, 0), 0), 0)

    def select(self, rows: torch.Tensor) -> Sequence:
        """Batch rows `rows` (a 1-D index tensor), in storage of their own."""
        view = self.view()
        return Sequence.of(view.index_select(0, rows.to(view.device)))

    def clone(self) -> Sequence:
        """An independent deep copy in one buffer."""
        return Sequence.of(self.view().clone())

    def storages(self) -> list[int]:
        """Data pointers of the storage this sequence reads, for sharing checks."""
        return [p.untyped_storage().data_ptr() for p in self.pieces()]

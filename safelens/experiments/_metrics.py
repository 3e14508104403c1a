"""Batched patching metrics: logits of many patched runs in, one value per run out.

A batched metric takes logits `[runs * batch, pos, d_vocab]`, where rows
`r * batch … (r + 1) * batch - 1` are patched run `r` of a `batch`-prompt corrupted
input, and returns `[runs]`. The sweeps call it once per forward pass, which is what
makes them fast; a TransformerLens-style metric (one run's logits to a scalar) is
called once per run instead. With `batch == 1` a batched metric is also a valid
TransformerLens metric: it returns one value for one run.

A metric that reads only the logits at the last position may say so with an attribute
`last_position_only = True` (as [`logit_diff_metric`][safelens.logit_diff_metric]'s
does). The sweeps then pass it `[runs * batch, 1, d_vocab]`, and skip the unembedding
of every other position and, where the patch site allows, the last layer's MLP there.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from jaxtyping import Float, Int

from ..core._errors import PatchingError, TokenError
from ..core._tokens import check_tokens

__all__ = ["logit_diff_metric"]


def _logits(value: Any, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise PatchingError(
            f"{name} must be a tensor [batch, pos, d_vocab], got {type(value).__name__}"
        )
    if value.dim() != 3 or value.numel() == 0 or not value.is_floating_point():
        raise PatchingError(
            f"{name} must be a non-empty floating tensor [batch, pos, d_vocab], got shape "
            f"{tuple(value.shape)} of {value.dtype}"
        )
    return value


def _answers(value: Any, batch: int, d_vocab: int, name: str) -> torch.Tensor:
    try:
        tokens = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise TokenError(
            f"{name} must be an int or an integer tensor [batch={batch}], got "
            f"{type(value).__name__}"
        ) from None
    if tokens.dim() > 1 or tokens.numel() not in (1, batch):
        raise PatchingError(
            f"{name} must be an int or an integer tensor [batch={batch}], got "
            f"{tokens.dtype} of shape {tuple(tokens.shape)}"
        )
    tokens = check_tokens(tokens.reshape(-1), SimpleNamespace(d_vocab=d_vocab), name, rank=1)
    return tokens.expand(batch)


def logit_diff_metric(
    clean_logits: Float[torch.Tensor, "batch pos d_vocab"],
    corrupted_logits: Float[torch.Tensor, "batch pos d_vocab"],
    answer_token: int | Int[torch.Tensor, " batch"],
    wrong_token: int | Int[torch.Tensor, " batch"],
) -> Callable[[Float[torch.Tensor, "rows pos d_vocab"]], Float[torch.Tensor, " runs"]]:
    """The normalised logit difference: 1 on the clean run, 0 on the corrupted run.

    For each run, the final-position logit of `answer_token` minus that of
    `wrong_token`, averaged over the batch, then mapped linearly so that the clean
    run's difference is 1 and the corrupted run's is 0.

    **Arguments:**

    - `clean_logits`, `corrupted_logits`: `[batch, pos, d_vocab]` of the two runs.
    - `answer_token`, `wrong_token`: the right and wrong next token, one for all
      prompts or one per prompt `[batch]`.

    **Returns:** a batched metric, logits `[runs * batch, pos, d_vocab]` to `[runs]`. It
    reads only the last position and says so (`metric.last_position_only` is `True`), so
    the sweeps hand it just that position's logits, `[runs * batch, 1, d_vocab]`.

    **Raises:** [`PatchingError`][safelens.PatchingError] when the two logits'
    shapes differ or the tokens do not fit the batch.

    ```python
    >>> clean, corrupted = torch.zeros(1, 3, 5), torch.zeros(1, 3, 5)
    >>> clean[0, -1, 2] = 4.0
    >>> metric = logit_diff_metric(clean, corrupted, answer_token=2, wrong_token=0)
    >>> metric(torch.cat([clean, corrupted, (clean + corrupted) / 2]))
    tensor([1.0000, 0.0000, 0.5000])

    ```
    """
    clean_logits = _logits(clean_logits, "clean_logits")
    corrupted_logits = _logits(corrupted_logits, "corrupted_logits")
    if clean_logits.shape != corrupted_logits.shape:
        raise PatchingError(
            f"clean_logits {tuple(clean_logits.shape)} and corrupted_logits "
            f"{tuple(corrupted_logits.shape)} must both be [batch, pos, d_vocab] of one shape"
        )
    batch, _, d_vocab = clean_logits.shape
    device = clean_logits.device
    right = _answers(answer_token, batch, d_vocab, "answer_token").to(device)
    wrong = _answers(wrong_token, batch, d_vocab, "wrong_token").to(device)
    if bool((right == wrong).all()):
        raise PatchingError(
            f"answer_token and wrong_token are the same token for every prompt "
            f"({right.tolist()}); their logit difference is always 0. Pass the token the "
            "corruption should make the model predict as wrong_token"
        )
    return _LogitDiff(batch, d_vocab, right, wrong)._normalised(clean_logits, corrupted_logits)


class _LogitDiff:
    """The batched metric `logit_diff_metric` returns (reads the last position only)."""

    last_position_only = True

    def __init__(self, batch: int, d_vocab: int, right: torch.Tensor, wrong: torch.Tensor) -> None:
        self.batch = batch
        self.d_vocab = d_vocab
        self.right = right
        self.wrong = wrong
        self.clean = self.corrupted = torch.zeros(())

    def _normalised(self, clean: torch.Tensor, corrupted: torch.Tensor) -> _LogitDiff:
        self.clean, self.corrupted = self._difference(clean), self._difference(corrupted)
        span = float(self.clean - self.corrupted)
        if span == 0 or not torch.isfinite(self.clean - self.corrupted):
            raise PatchingError(
                f"the clean and corrupted logit differences are {float(self.clean):.6g} and "
                f"{float(self.corrupted):.6g}; the normalised metric divides by their "
                f"difference ({span:.6g}), so it would be NaN or infinite. Use a corrupted "
                "prompt that changes the answer (and logits without NaN or infinities)"
            )
        return self

    def _difference(self, logits: torch.Tensor) -> torch.Tensor:
        last = logits[:, -1].reshape(-1, self.batch, logits.shape[-1])
        rows = torch.arange(self.batch, device=logits.device)
        return (last[:, rows, self.right] - last[:, rows, self.wrong]).mean(dim=1)

    def __call__(
        self, logits: Float[torch.Tensor, "rows pos d_vocab"]
    ) -> Float[torch.Tensor, " runs"]:
        if (
            not isinstance(logits, torch.Tensor)
            or logits.dim() != 3
            or logits.shape[0] % self.batch
            or logits.shape[0] == 0
            or logits.shape[1] == 0
            or logits.shape[2] != self.d_vocab
        ):
            raise PatchingError(
                f"logits of shape {tuple(getattr(logits, 'shape', ()))} are not [runs * "
                f"batch, pos, d_vocab] for batch={self.batch}, d_vocab={self.d_vocab}"
            )
        return (self._difference(logits) - self.corrupted) / (self.clean - self.corrupted)

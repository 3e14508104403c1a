"""A sweep's patching metric: batched (one value per patched run) or per run.

Sweeps hand `patching_metric` the logits of many patched runs at once, `[runs * batch,
pos, d_vocab]` (rows `r * batch … (r + 1) * batch - 1` are run `r`), and expect `[runs]`
back, as [`logit_diff_metric`][safelens.logit_diff_metric] gives. A TransformerLens-
style metric (the logits of one run to a scalar) works too: `_Metric` notices it at the
first call on several runs, when it returns one scalar for all of them, and from then
on calls it once per run.

Caveat: a metric is told apart by what it returns, so one that returns a scalar for
several runs on purpose (a sum over runs) is taken for a per-run metric.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from jaxtyping import Float

from ..core._errors import PatchingError

__all__ = ["Metric", "check_metric", "reads_last_position"]

Metric = Callable[[Float[torch.Tensor, "rows pos d_vocab"]], torch.Tensor]


def check_metric(metric: object, name: str = "patching_metric") -> None:
    """A `PatchingError` naming `name` unless `metric` can be called."""
    if not callable(metric):
        raise PatchingError(
            f"{name} must be a function of the logits, got {_describe(metric)}; pass e.g. "
            "lambda logits: logits[:, -1, answer] - logits[:, -1, wrong]"
        )


def reads_last_position(metric: object) -> bool:
    """Whether `metric` says it reads only the logits at the last position."""
    return getattr(metric, "last_position_only", False) is True


class _Metric:
    """A batched metric, or a per-run (TransformerLens-style scalar) one.

    Which it is shows at the first call with several runs: one value (a scalar, or a
    one-element tensor) for all of them means per-run. Whatever it returns is checked
    against what was expected.
    """

    def __init__(self, fn: Metric, batch: int) -> None:
        check_metric(fn)
        self.fn = fn
        self.batch = batch
        self.per_run: bool | None = None

    def __call__(self, logits: torch.Tensor, runs: int) -> torch.Tensor:
        if self.per_run:
            return torch.stack(
                [self._values(row, 1).reshape(()) for row in logits.split(self.batch)]
            )
        values = self._values(logits, runs, scalar_ok=self.per_run is None)
        if runs > 1:
            # One value for several runs: per run (TransformerLens takes any one-element
            # result, `.item()`).
            self.per_run = values.numel() == 1
            if self.per_run:
                return self(logits, runs)
        return values.reshape(runs)

    def _values(self, logits: torch.Tensor, runs: int, scalar_ok: bool = False) -> torch.Tensor:
        """What the metric returns for `logits` of `runs` runs, as a checked tensor."""
        value = self.fn(logits)
        values = None
        if isinstance(value, torch.Tensor | int | float) or hasattr(value, "__array__"):
            try:
                values = torch.as_tensor(value)
            except (TypeError, ValueError, RuntimeError):
                values = None
        if (
            values is None
            or values.is_complex()
            or not (values.numel() == runs or (scalar_ok and values.numel() == 1))
        ):
            got = f"shape {tuple(values.shape)}" if values is not None else _describe(value)
            if values is not None and values.is_complex():
                got += f" of {values.dtype}"
            raise PatchingError(
                f"patching_metric returned {got} for logits {tuple(logits.shape)} of {runs} "
                f"patched run{'s' if runs > 1 else ''}; expected a real tensor [{runs}] (a "
                "batched metric, one value per run) or a scalar per run (TransformerLens-"
                "style: the logits [batch, pos, d_vocab] of one run to a scalar)"
            )
        return values


def _describe(value: object) -> str:
    if value is None:
        return "None"
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"

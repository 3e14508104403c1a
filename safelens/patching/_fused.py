"""GELU's tanh approximation as PyTorch's one fused kernel inside a sweep's passes.

GPT-2's `gelu_new` (transformers' `NewGELUActivation`; TransformerLens' `gelu_new`, a
`HookedTransformer` MLP's `act_fn` for GPT-2 and the models converted from it) computes
`0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))` as seven tensor operations.
`tanh_gelu` computes the same formula, with the same constants, as
`torch.nn.functional.gelu(x, approximate="tanh")` (transformers' own
`gelu_pytorch_tanh`): the same numbers to float rounding (a unit or two in the last
place in float32 and float64), at a fifth of the time on a CPU. In half precision the
two differ by more (the model's own rounds at each of its seven steps, the kernel once),
so there the model's own runs. A sweep's passes take it
(`safelens.patching._hf_lean` on a HuggingFace model, `safelens.patching._grid` on a
`HookedTransformer`) through
[`overriding`][safelens.backends._override.overriding], on the sweep's thread only;
the corrupted run the passes reuse runs the model's own.

`gelu_fast` rounds its constant to ten digits (not the same numbers in float64) and is
left as it is.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["tanh_gelu"]


def tanh_gelu(own: Any, *args: Any, **kwargs: Any) -> Any:
    """`own(x)`, GELU's tanh approximation, as PyTorch's fused kernel (module notes).

    Called otherwise than with one tensor, or with one of fewer than 32 bits, `own` runs
    as it is.
    """
    if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
        return own(*args, **kwargs)
    if args[0].dtype not in (torch.float32, torch.float64):
        return own(*args)
    return F.gelu(args[0], approximate="tanh")

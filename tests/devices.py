"""The device and dtypes the tests run on, chosen by environment variables.

`SAFELENS_TEST_DEVICE` (default `cpu`; `cuda` or `cuda:1` on a GPU machine) is where the
model builders (`models`, `hf_models`, `bridge_models`) put every model and the token
ids they make. Tests parametrized over `DTYPES` (float32 and bfloat16:
`test_patching.py`'s) run in each on that device, with the tolerance `TOLERANCE` gives
each dtype; the HF cache and experiment tests name float32 and bfloat16 themselves.
"""

from __future__ import annotations

import os

import torch

DEVICE = torch.device(os.environ.get("SAFELENS_TEST_DEVICE", "cpu"))
DTYPES = (torch.float32, torch.bfloat16)
# Cached against uncached logits of the tiny test models: float32 agrees to rounding,
# bfloat16 (8 mantissa bits) to a few of its own steps at logits of size ~1.
TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=5e-2, rtol=5e-2),
}


def check_device() -> str | None:
    """Why `DEVICE` cannot be used here, or `None` when it can."""
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        return f"SAFELENS_TEST_DEVICE={DEVICE} but torch.cuda.is_available() is False"
    try:
        torch.empty(0, device=DEVICE)
    except (RuntimeError, AssertionError) as error:
        return f"SAFELENS_TEST_DEVICE={DEVICE} cannot hold a tensor: {error}"
    return None

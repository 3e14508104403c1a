"""Whether a TransformerBridge's attention uses `hook_pattern`: `check_pattern_hook`.

Pattern sweeps, the `*_every` bundles' pattern rows, and attribution's pattern grid and
QK fix all write or read `blocks.{layer}.attn.hook_pattern`. On a bridge that matters
only where the bridge's attention computes its output from what the hook returns, as
TransformerLens' Llama-style (rotary, grouped-query) and GPT-2 attention do; a bridge
that runs HuggingFace's own attention (TransformerLens' OPT adapter, for one) fires the
hook after the output is computed, or not at all, and every pattern patch would silently
give the corrupted run's metric. `check_pattern_hook` refuses such a bridge: one pass of
`n_layers + 1` copies of the first corrupted prompt zeroes each layer's pattern in one
copy, and every layer must change the logits or its own head outputs (`hook_z`).

Caveat: the check costs that one pass per sweep; other model families are not checked
(a `HookedTransformer` computes its pattern through the hook; a HuggingFace model's
pattern is patched inside its attention function).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..backends._families import backend_of, family_of
from ..core._errors import PatchingError
from ._clean_cache import sweep_tokens

__all__ = ["check_pattern_hook"]


def check_pattern_hook(model: Any, corrupted_tokens: Any, what: str) -> None:
    """On a bridge, a `PatchingError` naming the first layer whose attention ignores `hook_pattern`.

    One pass of `n_layers + 1` copies of the first corrupted prompt: in copy `l + 1`,
    layer `l`'s `hook_pattern` returns zeros; where its logits stay copy 0's (within a
    few float steps), that layer's attention does not use what the hook returns, or
    never fires it (a bridge that runs HuggingFace's own attention).
    """
    if family_of(model) != "bridge":
        return
    backend = backend_of(model, what)
    tokens = sweep_tokens(backend, corrupted_tokens, "corrupted_tokens")[:1]
    n_layers = backend.n_layers

    def zeroed(layer: int) -> Callable[..., torch.Tensor]:
        def hook(pattern: torch.Tensor, hook: Any = None) -> torch.Tensor:
            pattern = pattern.clone()
            pattern[layer + 1] = 0
            return pattern

        return hook

    names = [f"blocks.{layer}.attn.hook_pattern" for layer in range(n_layers)]
    heads: dict[int, torch.Tensor] = {}

    def kept(layer: int) -> Callable[..., None]:
        def hook(z: torch.Tensor, hook: Any = None) -> None:
            heads[layer] = z.detach().clone()

        return hook

    outputs = [(f"blocks.{layer}.attn.hook_z", kept(layer)) for layer in range(n_layers)]
    outputs = [(name, fn) for name, fn in outputs if name in model.hook_dict]
    copies = tokens.repeat(n_layers + 1, 1)
    cache = backend.empty_cache(n_layers + 1)  # holds no hook here; the pass runs without it
    hooks = [(name, zeroed(layer)) for layer, name in enumerate(names)] + outputs
    with torch.no_grad(), warnings.catch_warnings():
        # TransformerLens 4 warns of what this pass tests, where it holds
        warnings.filterwarnings("ignore", "A hook on .*hook_pattern returned a modified tensor")
        # This thread's pass alone: another thread's passes through the bridge meanwhile
        # see none of these hooks.
        with backend.pass_hooks(cache, hooks):  # type: ignore[arg-type]
            logits = model(copies)  # as `bridge(tokens)`: every position attended

    def moved(tensor: torch.Tensor | None, layer: int) -> bool:
        """Whether copy `layer + 1` of `tensor` differs from copy 0 (a few float steps)."""
        if tensor is None:
            return False
        bound = 8 * torch.finfo(tensor.dtype).eps * (1 + float(tensor[0].abs().max()))
        return float((tensor[layer + 1] - tensor[0]).abs().max()) > bound

    for layer, name in enumerate(names):
        # The layer's head outputs show the hook is used where its output projection (or
        # a hook of the user's) makes the logits blind to them.
        if not (moved(logits, layer) or moved(heads.get(layer), layer)):
            attention = type(model.blocks[layer].attn).__name__
            raise PatchingError(
                f"{what} patches {name}, which this bridge's attention ({attention}) does "
                "not use: zeroing the hook's tensor left the logits as they were (the "
                "bridge runs HuggingFace's own attention and fires the hook, if at all, "
                "after it), so every pattern patch would give the corrupted run's metric. "
                "Pattern sweeps need a bridge whose attention computes the pattern through "
                "the hook, as TransformerLens' Llama-style and GPT-2 attention do; sweep "
                "z, q, k or v here instead"
            )

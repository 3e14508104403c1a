"""`SupportedModel`: the models every safelens experiment and sweep takes.

Three families, each through its own adapter (`backend_of` recognises which): a
TransformerLens `HookedTransformer` (TransformerLens 3.x), a TransformerLens
`TransformerBridge` (3.9 and 4.x), and a HuggingFace causal LM (a `PreTrainedModel` such
as `LlamaForCausalLM` or `GPT2LMHeadModel`). The alias names them for signatures and the
API reference; importing it imports neither library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias, Union

if TYPE_CHECKING:
    from transformer_lens import HookedTransformer
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import PreTrainedModel

__all__ = ["SupportedModel"]

SupportedModel: TypeAlias = Union["HookedTransformer", "TransformerBridge", "PreTrainedModel"]
"""A model safelens accepts: a `HookedTransformer`, a `TransformerBridge` or a HuggingFace
causal LM (`PreTrainedModel`). A family that lacks a patching site is refused with the
reason (`PatchingError`)."""

"""Where a HuggingFace decoder layer's activations can be read and edited, in one thread's passes.

A HuggingFace causal LM carries no hook points inside its attention or between its
attention and MLP. Its activations are still reached at seams every family shares:

- *queries, attention scores and patterns*: the attention function transformers'
  `ALL_ATTENTION_FUNCTIONS` holds, which
  [`attention_edits`][safelens.backends.hf._attention_edits.attention_edits] dispatches
  to safelens for the modules being edited on the calling thread (queries `[batch,
  n_heads, pos, d_head]` after the rotary embedding; scores and patterns computed
  eagerly).
- *head outputs*: the input of the attention's output projection (`o_proj`, GPT-2's
  `c_proj`, `dense`, `out_proj`), seen as `[batch, pos, n_heads, d_head]`.
- *the residual stream between attention and MLP*: the input of the norm before the
  MLP ([`mlp_norm`][safelens.backends.hf._seams.mlp_norm]), or in the post-norm
  families that hand the MLP the residual stream itself (OLMo-2, OLMo-3, FlexOlmo,
  EXAONE-4) the MLP's input, edited in place, since the decoder layer adds the same
  tensor back after its MLP.
- *the residual stream entering a layer*: the decoder layer's input.

Edits are plain PyTorch pre-hooks, or dispatch entries, that act in the calling thread's
passes only and are removed when the block exits (also on error).

Caveat: a family whose attention computes outside `ALL_ATTENTION_FUNCTIONS` (GPT-2
with `reorder_and_upcast_attn`, a model's own attention registry) never reaches the
seam; `attention_edits` raises a `PatchingError` when an edited module's function did
not run through it.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from ...core._errors import PatchingError
from ._attention_edits import ATTENTION_POINTS, Edit, attention_edits

__all__ = [
    "ATTENTION_MODULES",
    "SEAMS",
    "Edit",
    "attention_function_module",
    "attention_module",
    "child_named",
    "input_edits",
    "mlp_norm",
    "output_projection",
    "seam_edits",
    "seam_modules",
]

# A decoder layer's attention module, by the names families give it (Llama and most:
# `self_attn`; GPT-2, GPT-J: `attn`; Falcon, BLOOM: `self_attention`; GPT-NeoX: `attention`).
ATTENTION_MODULES = ("self_attn", "attn", "self_attention", "attention")
# The attention's output projection, whose input is the head outputs.
OUTPUT_PROJECTIONS = ("o_proj", "c_proj", "dense", "out_proj")
# The norm before the MLP, in the order tried: Gemma-2/3 normalise the attention output
# too (`post_attention_layernorm`) and the MLP input with `pre_feedforward_layernorm`;
# Apertus names it `feedforward_layernorm`.
MLP_NORMS = (
    "pre_feedforward_layernorm",
    "post_attention_layernorm",
    "feedforward_layernorm",
    "ln_2",
)
# Post-norm families whose MLP reads the residual stream itself (`residual =
# hidden_states; hidden_states = self.mlp(hidden_states)`), normalising the attention's
# and the MLP's outputs before adding them: their resid_mid is the MLP's input.
POST_NORM_FAMILIES = frozenset({"olmo2", "olmo3", "flex_olmo", "exaone4"})
# Config flags of families whose attention and MLP read the same input in parallel.
PARALLEL_FLAGS = ("use_parallel_residual", "parallel_attn", "new_decoder_architecture")
PARALLEL_FAMILIES = frozenset(
    {
        "gptj",
        "phi",
        "cohere",
        "cohere2",
        "cohere2_moe",
        "cohere_compass",
        "codegen",
        "gpt_neox_japanese",
    }
)
# The activations reached at these seams (TransformerLens' names); the others of a
# HuggingFace model are the cache's hook points and modules' outputs.
SEAMS = frozenset({*ATTENTION_POINTS, "z", "resid_pre", "resid_mid"})


def child_named(layer: torch.nn.Module, names: tuple[str, ...]) -> str | None:
    """The first of `names` that is a module of decoder layer `layer`, or `None`."""
    return next(
        (name for name in names if isinstance(getattr(layer, name, None), torch.nn.Module)), None
    )


def _child(parent: torch.nn.Module, names: tuple[str, ...], missing: str) -> torch.nn.Module:
    """The first of `names` that is a module of `parent`; a `PatchingError(missing)` if none."""
    name = child_named(parent, names)
    if name is None:
        raise PatchingError(missing)
    module: torch.nn.Module = getattr(parent, name)
    return module


def attention_module(layer: torch.nn.Module, index: int) -> torch.nn.Module:
    """Decoder layer `index`'s attention module, or a `PatchingError` saying none was found."""
    return _child(
        layer,
        ATTENTION_MODULES,
        f"decoder layer {index} ({type(layer).__name__}) has no "
        f"{' or '.join(ATTENTION_MODULES)} module: no queries, head outputs or patterns "
        "to patch",
    )


def attention_function_module(layer: torch.nn.Module, index: int) -> torch.nn.Module:
    """Decoder layer `index`'s attention module, if it calls an `ALL_ATTENTION_FUNCTIONS` function.

    Read from the names its `forward`'s code refers to; a `PatchingError` saying why not.
    """
    module = attention_module(layer, index)
    forward = inspect.unwrap(type(module).forward)
    if "ALL_ATTENTION_FUNCTIONS" not in getattr(forward, "__code__", forward).co_names:
        raise PatchingError(
            f"{type(module).__name__} computes its attention without transformers' "
            "ALL_ATTENTION_FUNCTIONS, so its queries, scores and patterns cannot be "
            "reached; patch k, v, z, resid_pre, attn_out or mlp_out instead"
        )
    return module


def output_projection(layer: torch.nn.Module, index: int) -> torch.nn.Module:
    """The output projection of decoder layer `index`'s attention (its input: head outputs)."""
    attention = attention_module(layer, index)
    return _child(
        attention,
        OUTPUT_PROJECTIONS,
        f"the attention of decoder layer {index} ({type(attention).__name__}) has no "
        f"{' or '.join(OUTPUT_PROJECTIONS)} module, whose input would be the head outputs z",
    )


def mlp_norm(layer: torch.nn.Module, index: int, config: Any) -> torch.nn.Module:
    """The norm before decoder layer `index`'s MLP: its input is the residual stream `resid_mid`.

    In a post-norm family of `POST_NORM_FAMILIES`, the MLP itself, which reads the
    residual stream.

    **Raises:** `PatchingError` for a family with no residual stream between attention
    and MLP (parallel attention and MLP), another post-norm family, or none of
    `MLP_NORMS`.
    """
    family = getattr(config, "model_type", type(layer).__name__)
    flags = [flag for flag in PARALLEL_FLAGS if getattr(config, flag, False) is True]
    if flags or family in PARALLEL_FAMILIES:
        why = f" ({flags[0]}=True)" if flags else ""
        raise PatchingError(
            f"{family} computes attention and MLP in parallel from the same input{why}: "
            "there is no residual stream between them, so no resid_mid to patch; patch "
            "resid_pre, attn_out or mlp_out instead"
        )
    post_norm = hasattr(layer, "post_feedforward_layernorm")
    if family in POST_NORM_FAMILIES and post_norm and child_named(layer, ("mlp",)):
        mlp: torch.nn.Module = getattr(layer, "mlp")  # noqa: B009 - typed as a module
        return mlp
    name = child_named(layer, MLP_NORMS)
    if name is None or (name == "post_attention_layernorm" and post_norm):
        raise PatchingError(
            f"decoder layer {index} of {family} has no norm before its MLP "
            f"({', '.join(MLP_NORMS)}; a post-norm family normalises the attention output "
            "instead), whose input would be resid_mid; patch resid_pre, attn_out or mlp_out"
        )
    module: torch.nn.Module = getattr(layer, name)
    return module


def seam_modules(
    layers: Iterable[torch.nn.Module], config: Any, activation: str
) -> list[torch.nn.Module]:
    """The module of every decoder layer where `activation` (one of `SEAMS`) is edited.

    **Raises:** `PatchingError` naming why a family has no such seam.
    """
    if activation == "resid_pre":
        return list(layers)
    if activation == "resid_mid":
        return [mlp_norm(layer, index, config) for index, layer in enumerate(layers)]
    if activation == "z":
        return [output_projection(layer, index) for index, layer in enumerate(layers)]
    if activation in ATTENTION_POINTS:
        return [attention_function_module(layer, index) for index, layer in enumerate(layers)]
    raise PatchingError(
        f"activation {activation!r} has no seam here; expected one of {', '.join(sorted(SEAMS))}"
    )


@contextmanager
def seam_edits(
    layers: Iterable[torch.nn.Module], config: Any, edits: Mapping[str, Mapping[int, Edit]]
) -> Iterator[None]:
    """Within the block, `edits[activation][layer]` sees (and may edit) that seam's tensor.

    Queries `[batch, n_heads, pos, d_head]`, scores and patterns `[batch, n_heads,
    query_pos, key_pos]` (`attention_edits`), head outputs `[batch, pos, n_heads,
    d_head]`, `resid_mid` in place and `resid_pre` as the layer's input (`input_edits`);
    in the calling thread's passes only, removed on exit (also on error).
    """
    attention: dict[torch.nn.Module, dict[str, Edit]] = {}
    with ExitStack() as stack:
        for activation, by_layer in edits.items():
            if not by_layer:
                continue
            modules = seam_modules(layers, config, activation)
            chosen = {modules[layer]: edit for layer, edit in by_layer.items()}
            if activation in ATTENTION_POINTS:
                for module, edit in chosen.items():
                    attention.setdefault(module, {})[activation] = edit
            else:
                heads = int(config.num_attention_heads) if activation == "z" else 0
                stack.enter_context(input_edits(chosen, heads, activation == "resid_mid"))
        if attention:
            stack.enter_context(attention_edits(attention))
        yield


@contextmanager
def input_edits(
    edits: Mapping[torch.nn.Module, Edit], heads: int = 0, in_place: bool = False
) -> Iterator[None]:
    """Within the block, `edits[module]` sees (and may replace) `module`'s first input.

    `heads`: the input `[batch, pos, heads * d_head]` is seen as `[batch, pos, heads,
    d_head]`. `in_place`: what an edit returns is copied into the input itself (a
    residual stream the module's caller reuses). Thread-only pre-hooks (module notes).
    """
    me = threading.get_ident()

    def pre_hook(edit: Edit) -> Any:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
            # No `kwargs`: half-registered, in another thread's pass (`core._thread_hooks`).
            if threading.get_ident() != me or kwargs is None:
                return None
            tensor = args[0] if args else kwargs["hidden_states"]
            seen = tensor.unflatten(-1, (heads, -1)) if heads else tensor
            result = edit(seen)
            if result is None or result is seen:
                return None
            if in_place:
                seen.copy_(result)
                return None
            result = result.flatten(-2) if heads else result
            if args:
                return (result, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": result}

        return hook

    handles = []
    try:
        for module, edit in edits.items():
            handles.append(module.register_forward_pre_hook(pre_hook(edit), with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()

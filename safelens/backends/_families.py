"""Which family a model is of, and its adapter: `family_of`, `backend_of`.

A model's family is read from the names and modules of its class and its bases (a
subclass of a family's class belongs to it), never by importing another family's
library: `import safelens` and the experiments need neither TransformerLens nor
transformers. `backend_of` then imports that family's adapter alone
([`Backend`][safelens.backends._backend.Backend]). A model of no family is refused
naming what arrived, and, for a wrapper of a model (nnsight's, `torch.compile`'s,
`DataParallel`), where the model it wraps is (`wrapper_hint`).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from ._backend import Backend
from ._cache_ops import ancestry_of

__all__ = ["backend_of", "family_of", "wrapper_hint"]

# (family, class name in the MRO, its top-level module, the adapter module, the adapter
# class), in the order they are looked for.
_FAMILIES = (
    ("bridge", "TransformerBridge", "transformer_lens", ".bridge._backend", "BridgeBackend"),
    ("hooked", "HookedTransformer", "transformer_lens", ".hooked._backend", "HookedBackend"),
    ("hf", "GenerationMixin", "transformers", ".hf._backend", "HFBackend"),
)


def family_of(model: Any) -> str | None:
    """`model`'s family (`Backend.family`: "hooked", "bridge" or "hf"), read from its classes.

    `None` for anything else (an adapter too). Nothing is imported and nothing is checked:
    [`backend_of`][safelens.backends._families.backend_of] builds and checks the adapter.
    """
    ancestry = ancestry_of(model)
    for family, name, library, _, _ in _FAMILIES:
        if any(n == name and m.split(".")[0] == library for m, n in ancestry):
            return family
    return None


# Where common wrappers keep the model they wrap: nnsight's `NNsight` / `TransformersModel`,
# `torch.compile`'s `OptimizedModule`, `DataParallel` and `DistributedDataParallel`.
_WRAPPED_AT = ("_module", "_orig_mod", "module")


def wrapper_hint(model: Any) -> str:
    """For a wrapper of a model of a known family, the sentence that says how to unwrap it.

    Empty for anything else. Read by the errors that refuse a model of no family.
    """
    for name in _WRAPPED_AT:
        try:
            inner = getattr(model, name, None)
        except Exception:  # noqa: BLE001 - a wrapper whose attribute lookup itself fails
            continue
        if inner is not None and inner is not model and family_of(inner) is not None:
            return (
                f"; {type(model).__name__} wraps a {type(inner).__name__}: pass that "
                f"model (`model.{name}`)"
            )
    return ""


def backend_of(model: Any, what: str = "safelens") -> Backend:
    """The adapter of `model`'s family, recognised without importing other families' libraries.

    A `Backend` is returned as it is. The family is read from the names and modules of
    `type(model)` and its bases (a subclass of a family's class belongs to it), and only
    that family's adapter is imported.

    **Raises:** `TypeError` for a model of no known family, naming `what` (the
    calling function) and the families, and for a wrapper of a model (nnsight's,
    `torch.compile`'s, `DataParallel`) the attribute that holds it (`wrapper_hint`).

    ```python
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, vocab_size=10))
    >>> backend = backend_of(model)
    >>> backend.family, backend.n_layers, backend.caches.layout.shape_names()
    ('hf', 1, '[batch, n_kv_heads, pos, d_head]')

    ```
    """
    if isinstance(model, Backend):
        return model
    family = family_of(model)
    for name, _, _, module, adapter in _FAMILIES:
        if name == family:
            backend: Backend = getattr(import_module(module, __package__), adapter)(model)
            backend.check_model(what)
            return backend
    raise TypeError(
        f"{what} needs a TransformerLens HookedTransformer as model, got "
        f"{type(model).__name__}; it also takes a TransformerBridge or a HuggingFace causal "
        f"LM (a PreTrainedModel with generate){wrapper_hint(model)}"
    )

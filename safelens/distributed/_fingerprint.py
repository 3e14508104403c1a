"""What a sharded job is, as text that another process computes the same way.

A job's output folder records its fingerprint: one short string per part of the job (the
model's identity, each token tensor, the function and metric, every option). A job
restarted with that folder must have the same parts, else the folder is refused, and
the parts that differ are named.

Each part is computed from values, never from memory addresses or pickles, so it is the
same in any process and on any machine: a tensor by a SHA-256 of its dtype, shape and
bytes; a function by its module, qualified name, bytecode and constants, the values its
closure holds and its attributes (such as `last_position_only`); a
`functools.partial` by its function and arguments; an object by its class and
attributes. A model by its class and a SHA-256 of its state dict.

Caveat: a function is described by its own code and closure, not by the globals it
reads. A metric that reads a module-level tensor which then changes keeps its
fingerprint; start such a job in a new folder.
"""

from __future__ import annotations

import functools
import hashlib
import re
import types
from typing import Any

import torch

__all__ = ["describe", "model_identity", "tensor_digest"]

_DEPTH = 8  # nesting described before giving up (cyclic or very deep objects)
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # a default repr's address differs per process


def tensor_digest(tensor: torch.Tensor) -> str:
    """A SHA-256 of `tensor`'s dtype, shape and values, wherever it lies."""
    digest = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    if tensor.device.type != "meta":
        flat = tensor.detach().reshape(-1).contiguous().cpu()
        digest.update(flat.view(torch.uint8).numpy().data)
    return digest.hexdigest()[:32]


def model_identity(model: torch.nn.Module) -> str:
    """`model`'s class and a SHA-256 of its state dict (names, dtypes, shapes, values)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor_digest(tensor).encode())
    cls = type(model)
    return f"{cls.__module__}.{cls.__qualname__}:{digest.hexdigest()[:32]}"


def _code(code: types.CodeType) -> str:
    constants = [_code(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts]
    text = f"{code.co_code.hex()}|{constants}|{code.co_names}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def describe(value: Any, depth: int = 0) -> str:
    """`value` as text that equal values give in any process (see the module's caveat)."""
    if depth > _DEPTH:
        return "..."
    deeper = depth + 1
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return f"tensor:{tensor_digest(value)}"
    if isinstance(value, torch.dtype | torch.device):
        return str(value)
    if isinstance(value, list | tuple):
        return f"{type(value).__name__}[{', '.join(describe(v, deeper) for v in value)}]"
    if isinstance(value, dict):
        items = sorted((describe(k, deeper), describe(v, deeper)) for k, v in value.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(value, functools.partial):
        return (
            f"partial({describe(value.func, deeper)}, {describe(value.args, deeper)}, "
            f"{describe(value.keywords, deeper)})"
        )
    name = f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
    if isinstance(value, types.FunctionType):
        cells = [cell.cell_contents for cell in value.__closure__ or ()]
        return (
            f"function {name}:{_code(value.__code__)} closure={describe(cells, deeper)} "
            f"defaults={describe(value.__defaults__, deeper)} "
            f"attributes={describe(value.__dict__, deeper)}"
        )
    if isinstance(value, types.MethodType):
        return f"method {describe(value.__func__, deeper)} of {describe(value.__self__, deeper)}"
    if isinstance(value, type | types.BuiltinFunctionType | types.ModuleType):
        return f"{type(value).__name__} {name}"
    cls = type(value)
    state = getattr(value, "__dict__", None)
    described = describe(state, deeper) if state is not None else _ADDRESS.sub("", repr(value))
    return f"{cls.__module__}.{cls.__qualname__}{described}"

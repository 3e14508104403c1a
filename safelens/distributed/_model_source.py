"""Where each worker's model replica comes from: a picklable factory or a saved model's path.

A live model never travels through the driver: pickling it would copy every weight over
the wire once per worker (and a model on a GPU to a worker that may have none). Each
worker builds its own replica instead, from what the driver sends: a factory, a function
of no arguments returning the model (a module-level function, a `functools.partial`, a
lambda; Ray pickles it with cloudpickle), or the path of a model saved with
`save_pretrained`, loaded with `transformers.AutoModelForCausalLM.from_pretrained`.

A factory must build the same weights on every worker (load them, or seed the random
initialisation): the workers check it, comparing a hash of each replica's state dict.
A model the factory leaves on the CPU moves to the worker's GPU when Ray gave it one
(`num_gpus`); a model the factory placed itself (`device_map`, TransformerLens'
`n_devices`, anything off the CPU) stays where it is.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["ModelSource", "model_source"]

# A factory pickled larger than this holds weights (a live model in a closure, a state
# dict): the driver would send them to every worker, which is what factories avoid.
_MAX_FACTORY_BYTES = 16 << 20


@dataclass(frozen=True)
class ModelSource:
    """A factory or a saved model's directory, to build a replica from on a worker."""

    factory: Callable[[], Any] | None
    path: str | None

    def build(self) -> torch.nn.Module:
        """A new replica, in eval mode, on this worker's GPU if it has one and the model
        was left on the CPU."""
        model: Any
        if self.path is not None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.path)
        else:
            assert self.factory is not None
            model = self.factory()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"the model factory {self.describe()} returned {type(model).__name__}; it "
                "must return the model (a torch.nn.Module)"
            )
        devices = {p.device.type for p in model.parameters()}
        if devices == {"cpu"} and torch.cuda.is_available():
            model = model.to("cuda")
        return model.eval()

    def describe(self) -> str:
        if self.path is not None:
            return f"from_pretrained({self.path!r})"
        return getattr(self.factory, "__qualname__", type(self.factory).__name__)


def model_source(model: Any, pickle: Callable[[Any], bytes]) -> ModelSource:
    """`model` (a factory or a path) checked on the driver; `pickle` is Ray's cloudpickle.

    **Raises:** `TypeError` for a live model, something neither callable nor a path, a
    factory that cannot be pickled or that pickles to more than 16 MiB (it holds
    weights); `FileNotFoundError` for a path that is not a directory.
    """
    if isinstance(model, torch.nn.Module):
        raise TypeError(
            f"model must be a factory (a picklable function returning the model) or the "
            f"path of a saved model, got a live {type(model).__name__}: RayWorkers never "
            "pickles a live model through the driver (every weight would travel to every "
            "worker). Pass a function that builds it, e.g. functools.partial("
            "AutoModelForCausalLM.from_pretrained, path), or model.save_pretrained(path) "
            "and pass path"
        )
    if isinstance(model, str | os.PathLike):
        path = Path(model)
        if not path.is_dir():
            raise FileNotFoundError(
                f"model={str(model)!r} is not a directory; pass the directory a model was "
                "saved to with save_pretrained (it must be readable from every worker)"
            )
        return ModelSource(None, str(path.resolve()))
    if not callable(model):
        raise TypeError(
            f"model must be a factory (a picklable function returning the model) or the "
            f"path of a saved model, got {type(model).__name__}"
        )
    try:
        size = len(pickle(model))
    except Exception as error:
        raise TypeError(
            f"the model factory {getattr(model, '__qualname__', model)!r} cannot be pickled "
            f"for the workers ({type(error).__name__}: {error}); define it at module level "
            "or as a functools.partial of one"
        ) from error
    if size > _MAX_FACTORY_BYTES:
        raise TypeError(
            f"the model factory pickles to {size / (1 << 20):.0f} MiB, more than the "
            f"{_MAX_FACTORY_BYTES >> 20} MiB a factory needs: it holds weights (a live model "
            "or a state dict in its closure), which would travel to every worker. Build or "
            "load the model inside the factory"
        )
    return ModelSource(model, None)

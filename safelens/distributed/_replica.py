"""One model replica on one Ray worker: built there, then running shards of jobs.

The replica is a Ray actor. Its constructor sets torch's thread count to the CPUs Ray
gave the worker (so that one worker of `num_cpus=c` computes as one process of `c`
threads would, and workers sharing a machine do not oversubscribe it) and builds the
model from its `ModelSource`. A shard is an importable function applied to the model;
its tensors come back on the CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ._fingerprint import model_identity
from ._model_source import ModelSource
from ._ray import ray_module

__all__ = ["Replica", "replica_class"]


class Replica:
    """A model built on this worker, and the shards run on it."""

    def __init__(self, source: ModelSource, threads: int) -> None:
        torch.set_num_threads(threads)
        self.model = source.build()
        self.identity: str | None = None

    def model_identity(self) -> str:
        """The replica's class and state-dict hash (computed once)."""
        if self.identity is None:
            self.identity = model_identity(self.model)
        return self.identity

    def run(self, work: Callable[..., Any], *arguments: Any) -> Any:
        """`work(model, *arguments)`, its tensors moved to the CPU, under `no_grad`."""
        with torch.no_grad():
            result = work(self.model, *arguments)
        if isinstance(result, dict):
            return {name: value.cpu() for name, value in result.items()}
        return result


@functools.cache
def replica_class() -> Any:
    """`Replica` as a Ray actor class."""
    return ray_module().remote(Replica)

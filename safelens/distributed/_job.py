"""A sharded job: one function applied to a dataset's items, shard by shard, on workers.

A job cuts its items (prompt pairs, prompts) into shards of consecutive items; each shard
runs as one task on a free worker, `work(model, *inputs(start, stop))`, and returns a
dict of tensors. The driver hands out shards as workers free up, writes each result to
the output folder as it arrives, and shows one progress bar over the items.

Faults: a worker that dies mid-shard (its process exits, its machine goes away) is
replaced by a new replica and its shard is run again, up to `max_retries` times per
shard; a shard that kills its worker more often fails the job with a
[`WorkerError`][safelens.WorkerError]. An error the work itself raises (a bad metric, a
sweep's refusal) is no fault of the worker: it fails the job at once, as it would in one
process. Shards already written stay in the folder whatever happens, and a job run again
with that folder runs only the shards it lacks.

Caveat: when the job fails or is interrupted, the shards still running finish on their
workers and their results are dropped; closing the workers stops them.
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from ..core._arguments import flag, positive_int
from ..core._errors import WorkerError
from ._ray import ray_module
from ._shard_folder import Layout, ShardFolder

if TYPE_CHECKING:
    from ._workers import RayWorkers

__all__ = ["ShardedJob", "run_job"]


@dataclass(frozen=True)
class ShardedJob:
    """A function applied to `items` items in shards.

    - `what`: the items' name, for the progress bar ("pairs", "prompts").
    - `items`: how many items.
    - `work`: `work(model, *inputs) -> {name: tensor}`, run on a worker; an importable
      function, so that it travels by name.
    - `inputs`: `inputs(start, stop)`, the arguments of `work` for items `[start, stop)`.
    - `fingerprint`: what the job is (see `_fingerprint`), one string per part.
    - `max_shard`: the most items one shard may hold (a memory bound).
    - `shards_per_worker`: how many shards each worker gets when the caller does not size
      them (each no larger than `max_shard`): 1 where a shard batches its items together
      (pairs: a shard smaller than one process's chunk runs slower per pair, 20% at a
      quarter chunk on the benchmark), more where items run one by one (prompts), to
      even out their unequal lengths.
    """

    what: str
    items: int
    work: Callable[..., dict[str, torch.Tensor]]
    inputs: Callable[[int, int], tuple[Any, ...]]
    fingerprint: dict[str, str]
    max_shard: int
    shards_per_worker: int = 1


def _layout(job: ShardedJob, shard_size: int | None, workers: int) -> Layout:
    size = shard_size or math.ceil(job.items / (job.shards_per_worker * workers))
    size = max(1, min(size, job.max_shard))
    return [(start, min(start + size, job.items)) for start in range(0, job.items, size)]


def run_job(
    workers: RayWorkers,
    job: ShardedJob,
    shard_size: int | None,
    output_dir: str | os.PathLike[str] | None,
    progress: bool,
) -> list[dict[str, torch.Tensor]]:
    """Every shard's tensors, in item order, computed on `workers` or read from the folder.

    **Raises:** `TypeError` / `ValueError` for a `shard_size` or `progress` of the wrong
    type or range; [`JobFolderError`][safelens.JobFolderError] for a folder of another
    job or a shard file that cannot be read; [`WorkerError`][safelens.WorkerError] for a
    shard that kills its worker more than `max_retries` times; what the work raises.
    """
    positive_int(shard_size, "shard_size", optional=True)
    flag(progress, "progress")
    layout = _layout(job, shard_size, len(workers.actors))
    folder = None if output_dir is None else ShardFolder(output_dir, job.fingerprint)
    done: dict[int, dict[str, torch.Tensor]] = {}
    if folder is not None:
        layout = folder.open(layout, shard_size is not None)
        done = folder.finished(layout)
    ray = ray_module()
    pending = deque(index for index in range(len(layout)) if index not in done)
    idle = deque(range(len(workers.actors)))
    running: dict[Any, tuple[int, int]] = {}  # task -> (worker, shard)
    deaths = [0] * len(layout)
    finished = sum(layout[index][1] - layout[index][0] for index in done)
    with tqdm(total=job.items, initial=finished, disable=not progress, desc=job.what) as bar:
        while pending or running:
            while pending and idle:
                worker, index = idle.popleft(), pending.popleft()
                task = workers.actors[worker].run.remote(job.work, *job.inputs(*layout[index]))
                running[task] = (worker, index)
            [task], _ = ray.wait(list(running), num_returns=1)
            worker, index = running.pop(task)
            try:
                result = ray.get(task)
            except ray.exceptions.RayActorError as error:
                workers.replace(worker)
                deaths[index] += 1
                if deaths[index] > workers.max_retries:
                    raise WorkerError(
                        f"shard {layout[index]} (items {layout[index][0]} to "
                        f"{layout[index][1] - 1}) killed its worker {deaths[index]} times, "
                        f"more than max_retries={workers.max_retries}; the shard itself "
                        "kills workers (out of memory? a crash in the model?). Last: "
                        f"{type(error).__name__}: {error}"
                    ) from error
                pending.appendleft(index)
            else:
                if folder is not None:
                    folder.write(layout[index], result)
                done[index] = result
                bar.update(layout[index][1] - layout[index][0])
            idle.append(worker)
    return [done[index] for index in range(len(layout))]

"""Ray workers that each hold one model replica and run dataset jobs in shards.

[`RayWorkers`][safelens.RayWorkers] starts `n_workers` Ray actors, each asking Ray for
`num_cpus` CPUs and `num_gpus` GPUs (Ray places them: on this machine, or across a
cluster joined with `ray.init(address=...)` before), and builds one replica of the model
on each, from a factory or a saved model's path; a live model is refused. The replicas
must be equal: each hashes its state dict, and replicas whose hashes differ (a factory
that builds random weights without a seed) are refused before any job runs. The hash is
also the model's part of every job's fingerprint.

Its methods are the one-process functions over many items: `patch_dataset` and
`attribution_patch_dataset` over prompt pairs, `score_continuations` and `generate` over many prompts. Each equals its
one-process loop (see each method), returns its tensors on the driver's CPU, shows one
progress bar, and with `output_dir` writes every finished shard there, so that a job
run again with the same folder computes only what is missing (see
`safelens.distributed._job` for faults and `_shard_folder` for the folder).

What travels: to each worker once, the factory (or path); per shard, the shard's token
ids and the pickled function and metric (by name when importable, else by value); back,
each shard's result tensors. Never the weights. Ray is started here only when it is not
running yet, and then stopped by `close()`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from numbers import Real
from typing import Any

import torch

from ..core._arguments import is_int, positive_int
from ..core._errors import WorkerError
from ..experiments._continuations import ContinuationScores
from ..experiments._generation import Generation
from ..patching._attribution_dataset import AttributionDatasetResult
from ..patching._attribution_plan import HEAD_SITES, Activation
from ..patching._dataset import PatchingResult
from ..patching._dataset_chunks import PairMetric
from ..patching._limits import DEFAULT_MAX_BYTES
from ._attribution_job import attribution_job, attribution_result
from ._job import ShardedJob, run_job
from ._model_source import model_source
from ._patching_job import patching_job, patching_result
from ._prefix_jobs import (
    continuations_job,
    continuations_result,
    generation_job,
    generation_result,
    token_limits_of,
)
from ._ray import ray_module
from ._replica import replica_class

__all__ = ["RayWorkers"]


def _resources(value: Any, name: str, least: float) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not float(value) >= least:
        bound = "> 0" if least > 0 else ">= 0"
        raise ValueError(f"{name} must be a number {bound} (Ray's resources), got {value!r}")
    return float(value)


class RayWorkers:
    """Ray workers holding one model replica each, running dataset jobs in shards.

    **Arguments:**

    - `model`: a factory (a picklable function of no arguments that returns the model,
      the same weights on every call: loaded, or seeded) or the directory of a model
      saved with `save_pretrained`. Not a live model.
    - `n_workers`: how many workers (replicas); by default as many as the Ray cluster's
      free CPUs (GPUs, with `num_gpus`) hold. Workers that do not fit wait for Ray to
      free or add resources.
    - `num_cpus`, `num_gpus`: Ray resources each worker asks for; torch runs
      `max(1, int(num_cpus))` threads on each. A worker with a GPU moves a model its
      factory left on the CPU there.
    - `max_retries`: times a shard may be run again after its worker died.

    **Raises:** `ImportError` without Ray (`pip install 'safelens[ray]'`); `TypeError`
    for a live model or a factory that cannot travel; `ValueError` for resources or
    counts out of range, or resources the whole cluster lacks for one worker;
    [`WorkerError`][safelens.WorkerError] when a worker cannot build the model or the
    replicas differ.

    ```python
    >>> import functools, ray, transformers
    >>> _ = ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    >>> config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=20)
    >>> def build():
    ...     torch.manual_seed(0)
    ...     return transformers.GPT2LMHeadModel(config)
    >>> with RayWorkers(build, n_workers=1) as workers:
    ...     scores = workers.score_continuations([[1, 2, 3]], [[[4, 5], [6]]], progress=False)
    >>> scores[0].sums.shape
    torch.Size([2])
    >>> ray.shutdown()

    ```
    """

    def __init__(
        self,
        model: Callable[[], Any] | str | os.PathLike[str],
        n_workers: int | None = None,
        *,
        num_cpus: float = 1,
        num_gpus: float = 0,
        max_retries: int = 2,
    ) -> None:
        ray = ray_module()
        positive_int(n_workers, "n_workers", optional=True)
        self.num_cpus = _resources(num_cpus, "num_cpus", 1e-9)
        self.num_gpus = _resources(num_gpus, "num_gpus", 0)
        if not is_int(max_retries) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
        self.max_retries = max_retries
        self._source = model_source(model, ray.cloudpickle.dumps)
        self._started_ray = not ray.is_initialized()
        self.actors: list[Any] = []
        if self._started_ray:
            ray.init()
        try:
            fitting = self._fitting_workers(n_workers)
            count = n_workers or fitting
            self.actors = [self._start() for _ in range(count)]
            identities = self._identities(self.actors)
            if len(set(identities)) > 1:
                raise WorkerError(self._differ_message(identities))
            self.model_identity: str = identities[0]
            self.limits = self.call(token_limits_of)
        except BaseException:
            self.close()
            raise

    def _fitting_workers(self, n_workers: int | None) -> int:
        """How many workers the cluster's free resources hold; a `ValueError` when its
        whole resources cannot hold `n_workers` (or one): Ray would wait forever."""
        ray = ray_module()
        total = ray.cluster_resources()
        for name, wanted in (("CPU", self.num_cpus), ("GPU", self.num_gpus)):
            if total.get(name, 0) < wanted * (n_workers or 1):
                asked = f"num_{name.lower()}s={wanted:g}"
                if n_workers:
                    asked = f"{n_workers} workers of {asked}"
                raise ValueError(
                    f"{asked} need {wanted * (n_workers or 1):g} {name}s, but the Ray cluster "
                    f"has {total.get(name, 0):g} in all; ask for less, or start Ray on "
                    "machines that have them (ray.init(address=...))"
                )
        available = ray.available_resources()
        count = int(available.get("CPU", 0) // self.num_cpus)
        if self.num_gpus:
            count = min(count, int(available.get("GPU", 0) // self.num_gpus))
        return max(1, count)

    def _start(self) -> Any:
        options = dict(num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_restarts=0)
        threads = max(1, int(self.num_cpus))
        return replica_class().options(**options).remote(self._source, threads)

    def _identities(self, actors: list[Any]) -> list[str]:
        """Each replica's identity, once it is built; a `WorkerError` if one cannot be."""
        ray = ray_module()
        try:
            return ray.get([actor.model_identity.remote() for actor in actors])
        except ray.exceptions.RayActorError as error:
            raise WorkerError(
                f"a worker could not build the model from {self._source.describe()} (is the "
                "factory importable on the workers, with its module on their PYTHONPATH, "
                f"or the path readable there?): {error}"
            ) from error

    def _differ_message(self, identities: list[str]) -> str:
        return (
            f"the model factory {self._source.describe()} built different weights on "
            f"different workers (state-dict hashes {sorted(set(identities))}); every replica "
            "must be the same model: load saved weights, or seed the initialisation inside "
            "the factory (torch.manual_seed)"
        )

    def replace(self, worker: int) -> None:
        """Start a new replica in place of worker `worker` (which died)."""
        ray = ray_module()
        ray.kill(self.actors[worker])
        self.actors[worker] = self._start()
        [identity] = self._identities([self.actors[worker]])
        if identity != self.model_identity:
            raise WorkerError(self._differ_message([self.model_identity, identity]))

    def call(self, function: Callable[..., Any], *arguments: Any) -> Any:
        """`function(model, *arguments)` on the first replica (an importable function).

        A first worker found dead (one that died after an earlier job failed for another
        reason, whose shards it was running are dropped) is replaced and asked again, up
        to `max_retries` times (at least once); then a `WorkerError`.
        """
        ray = ray_module()
        tries = max(1, self.max_retries) + 1
        for attempt in range(tries):
            try:
                return ray.get(self.actors[0].run.remote(function, *arguments))
            except ray.exceptions.RayActorError as error:
                died = error
                if attempt + 1 < tries:
                    self.replace(0)
        raise WorkerError(
            f"the first worker died on every one of {tries} tries to run "
            f"{getattr(function, '__name__', function)!r}: {died}"
        ) from died

    def run(
        self,
        job: ShardedJob,
        shard_size: int | None = None,
        output_dir: str | os.PathLike[str] | None = None,
        progress: bool = True,
    ) -> list[dict[str, torch.Tensor]]:
        """Run `job` (see `safelens.distributed._job`); each shard's tensors, in order."""
        return run_job(self, job, shard_size, output_dir, progress)

    def close(self) -> None:
        """Stop the workers (and Ray, if these workers started it)."""
        ray = ray_module()
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        self._started_ray = False

    def __enter__(self) -> RayWorkers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def patch_dataset(
        self,
        sweep: Callable[..., torch.Tensor],
        clean_tokens: Any,
        corrupted_tokens: Any,
        metric: Callable[..., torch.Tensor],
        *,
        n_bootstrap: int = 1000,
        confidence: float = 0.95,
        seed: int = 0,
        max_batch: int | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        shard_size: int | None = None,
        output_dir: str | os.PathLike[str] | None = None,
        progress: bool = True,
    ) -> PatchingResult:
        """[`patch_dataset`][safelens.patch_dataset] with its pairs sharded on the workers.

        Arguments as `patch_dataset`'s (`model` is the workers'), and `shard_size` (pairs
        per shard: by default one shard per worker, never more than one `patch_dataset`
        chunk of `max_bytes`) and `output_dir` (a folder for the
        finished shards, to resume from). The `sweep` and `metric` travel pickled.

        **Returns:** the [`PatchingResult`][safelens.PatchingResult] `patch_dataset` gives
        with the same arguments, on the CPU: bitwise equal where each shard is one of its
        chunks, else within float32 rounding (a chunk's pairs batched differently).

        **Raises:** what `patch_dataset` raises, on the driver before anything runs where
        it can (options, token ids); what `run_job` raises.
        """
        job = patching_job(
            self, sweep, clean_tokens, corrupted_tokens, metric,
            n_bootstrap, confidence, seed, max_batch, max_bytes, progress,
        )  # fmt: skip
        shards = self.run(job, shard_size, output_dir, progress)
        return patching_result(shards, n_bootstrap, confidence, seed)

    def attribution_patch_dataset(
        self,
        clean_tokens: Any,
        corrupted_tokens: Any,
        metric: PairMetric,
        *,
        activations: Sequence[Activation] = HEAD_SITES,
        qk_fix: bool = True,
        n_bootstrap: int = 1000,
        confidence: float = 0.95,
        seed: int = 0,
        max_bytes: int = DEFAULT_MAX_BYTES,
        shard_size: int | None = None,
        output_dir: str | os.PathLike[str] | None = None,
        progress: bool = True,
    ) -> AttributionDatasetResult:
        """[`attribution_patch_dataset`][safelens.attribution_patch_dataset] with its pairs
        sharded on the workers.

        Arguments as `attribution_patch_dataset`'s (`model` is the workers'), and
        `shard_size` (pairs per shard, never more than one of its chunks of `max_bytes`)
        and `output_dir` as in `patch_dataset`. The `metric` travels pickled.

        **Returns:** the [`AttributionDatasetResult`][safelens.AttributionDatasetResult]
        `attribution_patch_dataset` gives with the same arguments, on the CPU: bitwise
        equal where each shard is one of its chunks, else within float32 rounding.

        **Raises:** what `attribution_patch_dataset` raises, before anything runs where
        it can (options, token ids, activations, `qk_fix`); what `run_job` raises.
        """
        job = attribution_job(
            self, clean_tokens, corrupted_tokens, metric, activations, qk_fix,
            n_bootstrap, confidence, seed, max_bytes, progress,
        )  # fmt: skip
        shards = self.run(job, shard_size, output_dir, progress)
        return attribution_result(shards, activations, n_bootstrap, confidence, seed)

    def score_continuations(
        self,
        prompts: Sequence[Any] | torch.Tensor,
        continuations: Sequence[Any],
        *,
        batch_size: int | None = None,
        memory_budget: int | None = None,
        shard_size: int | None = None,
        output_dir: str | os.PathLike[str] | None = None,
        progress: bool = True,
    ) -> list[ContinuationScores]:
        """[`score_continuations`][safelens.score_continuations] after each of many prompts.

        Prompt `i` (1-D token ids) is run once with [`prefill`][safelens.prefill] and its
        continuations `continuations[i]` (what `score_continuations` takes) are scored
        from it. `batch_size` and `memory_budget` are `score_continuations`'; `shard_size`
        (prompts per shard) and `output_dir` as in `patch_dataset`.

        **Returns:** one [`ContinuationScores`][safelens.ContinuationScores] per prompt,
        equal to `score_continuations(model, prefill(model, prompt[None]), ...)`.

        **Raises:** [`TokenError`][safelens.TokenError] for prompts or continuations that
        are not token ids of the model; `ValueError` when there are not as many
        continuation lists as prompts; what `score_continuations` and `run_job` raise.
        """
        job = continuations_job(self, prompts, continuations, batch_size, memory_budget)
        shards = self.run(job, shard_size, output_dir, progress)
        return continuations_result(shards, job.items)

    def generate(
        self,
        prompts: Sequence[Any] | torch.Tensor,
        max_new_tokens: int,
        *,
        n_samples: int = 1,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop_tokens: Sequence[int] | None = None,
        pad_token: int | None = None,
        shard_size: int | None = None,
        output_dir: str | os.PathLike[str] | None = None,
        progress: bool = True,
    ) -> list[Generation]:
        """[`generate`][safelens.generate] after each of many prompts.

        Arguments as `generate`'s, with `prompts` (1-D token ids each) for its prefix;
        sampling needs a `seed`, and prompt `i` samples with `seed + i`. `shard_size`
        (prompts per shard) and `output_dir` as in `patch_dataset`.

        **Returns:** one [`Generation`][safelens.Generation] per prompt, equal to
        `generate(model, prefill(model, prompt[None]), ..., seed=seed + i)`.

        **Raises:** `ValueError` for sampling without a seed; what `generate` raises
        (sampling settings, token ids); what `run_job` raises.
        """
        options = dict(
            n_samples=n_samples, do_sample=do_sample, temperature=temperature, top_k=top_k,
            top_p=top_p, stop_tokens=stop_tokens, pad_token=pad_token,
        )  # fmt: skip
        job = generation_job(self, prompts, max_new_tokens, seed, options)
        shards = self.run(job, shard_size, output_dir, progress)
        return generation_result(shards, job.items)

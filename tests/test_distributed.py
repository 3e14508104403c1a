"""Dataset jobs on Ray workers (`safelens.RayWorkers`) against the same jobs in one process.

One local Ray instance (2 CPUs) serves the module, and one pair of workers most tests:
each holds the tiny Llama of `hf_models`, built on the worker by `watched_llama`, which
also logs every forward pass's input rows to a file and, when told through another
file, kills its worker at the first pass that holds a given row. The references are
`patch_dataset`, `score_continuations` and `generate` run here, in this process, on the
same model. Runs under TransformerLens 3.9 and 4.x (HuggingFace models only).
"""

from __future__ import annotations

import functools
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from hf_models import CONFIGS, ids, model

import safelens
from safelens import (
    JobFolderError,
    PatchingError,
    RayWorkers,
    TokenError,
    WorkerError,
    generate,
    patch_dataset,
    prefill,
    score_continuations,
)
from safelens.distributed._fingerprint import describe, model_identity
from safelens.distributed._model_source import ModelSource, model_source
from safelens.distributed._shard_folder import ShardFolder
from safelens.patching._dataset import dataset_backend
from safelens.patching._dataset_chunks import pair_bytes

ray = pytest.importorskip("ray")

TESTS = Path(__file__).resolve().parent
PAIRS, LENGTH = 8, 5
ANSWERS = torch.arange(PAIRS) % 7 + 3
SWEEP = safelens.get_act_patch_attn_head_k_by_pos


def pair_metric(logits: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """Each pair's own answer logit at the last position, less the mean logit."""
    last = logits[:, -1]
    return last[torch.arange(last.shape[0]), ANSWERS[pairs]] - last.mean(-1)


def other_metric(logits: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 0]


def pairs_of(n: int = PAIRS) -> tuple[torch.Tensor, torch.Tensor]:
    clean = ids(n, LENGTH, seed=4)
    corrupted = clean.clone()
    corrupted[:, 1] = ids(n, 1, seed=5)[:, 0]
    corrupted[:, 3] = ids(n, 1, seed=6)[:, 0]
    return clean, corrupted


def row_text(row: torch.Tensor) -> str:
    return " ".join(map(str, row.tolist()))


def watched_llama(control: str) -> torch.nn.Module:
    """`hf_models.model("llama")`, logging each pass's rows to `control/passes`; a pass
    holding the row written in `control/die-on` kills this worker (once: the first to
    remove the file)."""
    lm = model("llama")
    folder = Path(control)

    def watch(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        rows = [row_text(row) for row in args[0]]
        with (folder / "passes").open("a") as log:
            log.write("".join(f"{row}\n" for row in rows))
        die_on = folder / "die-on"
        try:  # another worker may remove it at any moment
            if die_on.read_text() not in rows:
                return
            die_on.unlink()
        except FileNotFoundError:
            return
        os._exit(1)

    lm.model.embed_tokens.register_forward_pre_hook(watch)
    return lm


def recomputed(control: Path, clean: torch.Tensor) -> set[int]:
    """The pairs whose clean prompt some worker ran since the log was last cleared."""
    log = control / "passes"
    seen = set(log.read_text().splitlines()) if log.exists() else set()
    log.unlink(missing_ok=True)
    return {i for i, row in enumerate(clean) if row_text(row) in seen}


@pytest.fixture(scope="module")
def ray_instance():
    """A local Ray instance of 2 CPUs whose workers import from tests/, stopped after."""
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), path]))
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    finally:
        if path is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = path
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def control(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("control")


@pytest.fixture(scope="module")
def workers(ray_instance, control: Path):
    # Half a CPU each, so that tests can start two more workers beside them.
    factory = functools.partial(watched_llama, str(control))
    with RayWorkers(factory, n_workers=2, num_cpus=0.5) as pool:
        yield pool


@pytest.fixture
def one_thread():
    """torch on one thread here, as on the workers (`num_cpus=1`): matmuls of other thread
    counts may round differently."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_results_equal(ours: safelens.PatchingResult, reference: safelens.PatchingResult):
    for field in ("per_pair", "mean", "std_err", "ci_low", "ci_high"):
        assert torch.equal(getattr(ours, field), getattr(reference, field)), field


# -- equality with one process ---------------------------------------------------------


def test_patch_dataset_equals_one_process_bitwise_when_shards_are_its_chunks(workers, one_thread):
    clean, corrupted = pairs_of()
    two_pairs = 2 * pair_bytes(dataset_backend(model("llama")), LENGTH)
    reference = patch_dataset(
        SWEEP, model("llama"), clean, corrupted, pair_metric, max_bytes=two_pairs, progress=False
    )
    ours = workers.patch_dataset(
        SWEEP, clean, corrupted, pair_metric, max_bytes=two_pairs, shard_size=2, progress=False
    )
    assert ours.per_pair.shape == (PAIRS, 2, LENGTH, 2)
    assert_results_equal(ours, reference)
    assert (ours.confidence, ours.n_bootstrap) == (reference.confidence, reference.n_bootstrap)


def test_patch_dataset_in_other_shards_is_within_float32_rounding(workers):
    clean, corrupted = pairs_of()
    reference = patch_dataset(SWEEP, model("llama"), clean, corrupted, pair_metric, progress=False)
    ours = workers.patch_dataset(SWEEP, clean, corrupted, pair_metric, shard_size=3, seed=0)
    for field in ("per_pair", "mean", "std_err", "ci_low", "ci_high"):
        difference = (getattr(ours, field) - getattr(reference, field)).abs().max()
        assert difference <= 1e-6, field


SITES = ("k", "v", "resid_pre")


def assert_attributions_equal(ours, reference, tolerance: float = 0.0):
    pairs = [("baseline", ours.baseline, reference.baseline)]
    pairs += [(name, ours.estimates[name], reference.estimates[name]) for name in SITES]
    assert list(ours.estimates) == list(reference.estimates) == list(SITES)
    for name, mine, theirs in pairs:
        for field in ("per_pair", "mean", "std_err", "ci_low", "ci_high"):
            difference = (getattr(mine, field) - getattr(theirs, field)).abs().max()
            assert difference <= tolerance, (name, field)


def test_attribution_over_a_dataset_equals_one_process_bitwise_when_shards_are_its_chunks(
    workers, one_thread
):
    clean, corrupted = pairs_of()
    two_pairs = 2 * 4 * pair_bytes(dataset_backend(model("llama")), LENGTH)
    run = functools.partial(
        safelens.attribution_patch_dataset, model("llama"), clean, corrupted, pair_metric,
        activations=SITES, max_bytes=two_pairs, progress=False,
    )  # fmt: skip
    reference = run()
    ours = workers.attribution_patch_dataset(
        clean, corrupted, pair_metric, activations=SITES, max_bytes=two_pairs, shard_size=2,
        progress=False,
    )  # fmt: skip
    assert ours.estimates["k"].per_pair.shape == (PAIRS, 2, LENGTH, 2)
    assert_attributions_equal(ours, reference)


def test_continuations_and_generation_equal_a_loop_over_the_prompts(workers, one_thread):
    lm = model("llama")
    prompts = [ids(1, 4, seed=7)[0], ids(1, 6, seed=8)[0], ids(1, 3, seed=9)[0]]
    continuations = [[[4, 5, 6], [7]], [ids(1, 2, seed=10)[0]], [[1], [2, 3], [4, 5, 6, 7]]]
    scores = workers.score_continuations(prompts, continuations, shard_size=2, progress=False)
    samples = workers.generate(prompts, 4, n_samples=2, do_sample=True, seed=11, progress=False)
    for i, prompt in enumerate(prompts):
        prefix = prefill(lm, prompt[None])
        expected = score_continuations(lm, prefix, continuations[i])
        for field in ("log_probs", "mask", "sums"):
            assert torch.equal(getattr(scores[i], field), getattr(expected, field)), (i, field)
        drawn = generate(lm, prefix, 4, n_samples=2, do_sample=True, seed=11 + i)
        for field in ("tokens", "lengths", "log_probs"):
            assert torch.equal(getattr(samples[i], field), getattr(drawn, field)), (i, field)


# -- faults and resume -----------------------------------------------------------------


def test_a_worker_that_dies_mid_job_has_its_shard_rerun(workers, control: Path):
    clean, corrupted = pairs_of()
    reference = patch_dataset(SWEEP, model("llama"), clean, corrupted, pair_metric, progress=False)
    recomputed(control, clean)
    (control / "die-on").write_text(row_text(clean[5]))  # the worker of pairs 4, 5 dies
    before = list(workers.actors)
    ours = workers.patch_dataset(SWEEP, clean, corrupted, pair_metric, shard_size=2, progress=False)
    assert not (control / "die-on").exists()  # a worker did die
    assert sum(a != b for a, b in zip(before, workers.actors, strict=True)) == 1
    assert recomputed(control, clean) == set(range(PAIRS))
    for field in ("per_pair", "mean", "std_err", "ci_low", "ci_high"):
        assert (getattr(ours, field) - getattr(reference, field)).abs().max() <= 1e-6


def test_a_shard_that_kills_its_worker_too_often_fails_the_job(workers, control: Path):
    clean, corrupted = pairs_of()
    (control / "die-on").write_text(row_text(clean[2]))
    workers.max_retries = 0
    try:
        with pytest.raises(
            WorkerError, match=r"shard \(2, 4\) \(items 2 to 3\) killed its worker 1"
        ):
            workers.patch_dataset(
                SWEEP, clean, corrupted, pair_metric, shard_size=2, progress=False
            )
    finally:
        workers.max_retries = 2
    reference = patch_dataset(SWEEP, model("llama"), clean, corrupted, pair_metric, progress=False)
    ours = workers.patch_dataset(SWEEP, clean, corrupted, pair_metric, progress=False)
    assert (ours.per_pair - reference.per_pair).abs().max() <= 1e-6  # the worker was replaced


def test_a_first_worker_found_dead_between_jobs_is_replaced(workers):
    """A worker can die outside any job (or while a job that failed for another reason
    still ran a shard on it): the next job's first call on it starts a new one."""
    clean, corrupted = pairs_of()
    ray.kill(workers.actors[0])
    first = workers.actors[0]
    reference = patch_dataset(SWEEP, model("llama"), clean, corrupted, pair_metric, progress=False)
    ours = workers.patch_dataset(SWEEP, clean, corrupted, pair_metric, progress=False)
    assert workers.actors[0] is not first
    assert (ours.per_pair - reference.per_pair).abs().max() <= 1e-6


def test_an_interrupted_job_resumes_computing_only_missing_shards(
    workers, control: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread
):
    clean, corrupted = pairs_of()
    two_pairs = 2 * pair_bytes(dataset_backend(model("llama")), LENGTH)
    reference = patch_dataset(
        SWEEP, model("llama"), clean, corrupted, pair_metric, max_bytes=two_pairs, progress=False
    )
    job = functools.partial(
        workers.patch_dataset, SWEEP, clean, corrupted, pair_metric, max_bytes=two_pairs,
        shard_size=2, output_dir=tmp_path / "run", progress=False,
    )  # fmt: skip
    write = ShardFolder.write
    written: list[tuple[int, int]] = []

    def interrupted_write(self, span, tensors):
        write(self, span, tensors)
        written.append(span)
        if len(written) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(ShardFolder, "write", interrupted_write)
    recomputed(control, clean)
    with pytest.raises(KeyboardInterrupt):
        job()
    monkeypatch.undo()
    shards = sorted(p.name for p in (tmp_path / "run").glob("shard-*.safetensors"))
    assert len(shards) == 2
    finished = {pair for start, stop in written for pair in range(start, stop)}
    recomputed(control, clean)
    assert_results_equal(job(), reference)
    assert recomputed(control, clean) == set(range(PAIRS)) - finished
    assert_results_equal(job(), reference)  # everything finished: nothing runs
    assert recomputed(control, clean) == set()


def test_an_interrupted_attribution_resumes_and_refuses_a_folder_of_another_job(
    workers, control: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    clean, corrupted = pairs_of()
    reference = safelens.attribution_patch_dataset(
        model("llama"), clean, corrupted, pair_metric, activations=SITES, progress=False
    )
    run = functools.partial(
        workers.attribution_patch_dataset, clean, corrupted, pair_metric, shard_size=3,
        output_dir=tmp_path, progress=False,
    )  # fmt: skip
    write = ShardFolder.write
    written: list[tuple[int, int]] = []

    def interrupted_write(self, span, tensors):
        write(self, span, tensors)
        written.append(span)
        raise KeyboardInterrupt

    monkeypatch.setattr(ShardFolder, "write", interrupted_write)
    recomputed(control, clean)
    with pytest.raises(KeyboardInterrupt):
        run(activations=SITES)
    monkeypatch.undo()
    [(start, stop)] = written
    recomputed(control, clean)
    # Other shards than one process's chunk (all pairs): within float32 rounding.
    assert_attributions_equal(run(activations=SITES), reference, tolerance=1e-6)
    assert recomputed(control, clean) == set(range(PAIRS)) - set(range(start, stop))
    with pytest.raises(JobFolderError, match=r"another job: its activations differ"):
        run(activations=SITES[:2])
    with pytest.raises(JobFolderError, match=r"another job: its options differ"):
        run(activations=SITES, qk_fix=False)
    with pytest.raises(JobFolderError, match=r"another job: its .*job.* differ"):
        workers.patch_dataset(SWEEP, clean, corrupted, pair_metric, output_dir=tmp_path)
    assert recomputed(control, clean) == set()


def test_a_folder_of_another_job_is_refused(workers, tmp_path: Path):
    clean, corrupted = pairs_of()
    run = functools.partial(workers.patch_dataset, output_dir=tmp_path, progress=False)
    run(SWEEP, clean, corrupted, pair_metric)
    with pytest.raises(JobFolderError, match=r"holds the shards of another job: its metric differ"):
        run(SWEEP, clean, corrupted, other_metric)
    with pytest.raises(JobFolderError, match=r"its sweep differ"):
        run(safelens.get_act_patch_resid_pre, clean, corrupted, pair_metric)
    with pytest.raises(JobFolderError, match=r"its clean_tokens differ"):
        run(SWEEP, clean.flip(0), corrupted, pair_metric)
    with pytest.raises(JobFolderError, match=r"its options differ"):
        run(SWEEP, clean, corrupted, pair_metric, seed=1)
    with pytest.raises(JobFolderError, match=r"job\.json is not the record"):
        (tmp_path / "job.json").write_text("{}")
        run(SWEEP, clean, corrupted, pair_metric)


def test_a_corrupt_shard_is_refused_and_recomputed_once_deleted(workers, tmp_path: Path):
    clean, corrupted = pairs_of()
    run = functools.partial(
        workers.patch_dataset, SWEEP, clean, corrupted, pair_metric, output_dir=tmp_path,
        shard_size=4, progress=False,
    )  # fmt: skip
    reference = run()
    shard = sorted(tmp_path.glob("shard-*.safetensors"))[1]
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(
        JobFolderError, match=r"cannot be used: tensor 'per_pair' has bytes whose CRC"
    ):
        run()
    shard.write_bytes(bytes(raw[:-8]))
    with pytest.raises(JobFolderError, match=r"cannot be used: .* is truncated or corrupt"):
        run()
    shard.unlink()
    assert_results_equal(run(), reference)


def test_shard_folder_names_the_parts_of_the_job_that_differ(tmp_path: Path):
    fingerprint = {"model": "a", "metric": "m", "sweep": "s"}
    ShardFolder(tmp_path, fingerprint).open([(0, 2)], False)
    other = ShardFolder(tmp_path, fingerprint | {"model": "b"})
    with pytest.raises(JobFolderError, match=r"its model differ \(model: saved 'a', now 'b'\)"):
        other.open([(0, 2)], False)
    folder = ShardFolder(tmp_path, fingerprint)
    assert folder.open([(0, 1), (1, 2)], False) == [(0, 2)]  # the folder's own layout
    with pytest.raises(
        JobFolderError, match=r"cut into 1 shards, but shard_size now cuts it into 2"
    ):
        folder.open([(0, 1), (1, 2)], True)
    folder.write((0, 2), {"x": torch.arange(6.0).reshape(1, 2, 3, 1, 1)})
    assert torch.equal(folder.finished([(0, 2)])[0]["x"], torch.arange(6.0).reshape(1, 2, 3, 1, 1))
    stranger = ShardFolder(tmp_path / "other", fingerprint | {"metric": "n"})
    stranger.open([(0, 2)], False)
    shutil.copy(folder.shard_path((0, 2)), stranger.shard_path((0, 2)))
    with pytest.raises(JobFolderError, match=r"it belongs to job '[0-9a-f]+', not"):
        stranger.finished([(0, 2)])


# -- what is refused before anything runs ----------------------------------------------


def test_bad_input_is_refused_on_the_driver(workers):
    clean, corrupted = pairs_of()
    with pytest.raises(TokenError, match=r"clean_tokens"):
        workers.patch_dataset(SWEEP, clean + 100, corrupted, pair_metric)
    with pytest.raises(PatchingError, match=r"must have one shape"):
        workers.patch_dataset(SWEEP, clean, corrupted[:3], pair_metric)
    with pytest.raises(PatchingError, match=r"metric must be a function, got str"):
        workers.patch_dataset(SWEEP, clean, corrupted, "logit_diff")
    with pytest.raises(ValueError, match=r"shard_size must be a positive int"):
        workers.patch_dataset(SWEEP, clean, corrupted, pair_metric, shard_size=0)
    with pytest.raises(ValueError, match=r"one list of continuations per prompt \(2\), got 1"):
        workers.score_continuations([[1, 2], [3]], [[[4]]])
    with pytest.raises(TokenError, match=r"prompts\[1\]"):
        workers.score_continuations([[1, 2], [3, 99]], [[[4]], [[5]]])
    with pytest.raises(ValueError, match=r"do_sample=True needs a seed"):
        workers.generate([[1, 2]], 3, do_sample=True)


def test_a_live_model_or_a_factory_holding_weights_is_refused():
    with pytest.raises(TypeError, match=r"got a live LlamaForCausalLM: RayWorkers never pickles"):
        RayWorkers(model("llama"))
    weights = torch.zeros(8 << 20)
    with pytest.raises(TypeError, match=r"the model factory pickles to 32 MiB, more than the 16"):
        RayWorkers(lambda: weights)
    with pytest.raises(FileNotFoundError, match=r"is not a directory"):
        RayWorkers("no/such/folder")
    with pytest.raises(ValueError, match=r"num_cpus must be a number > 0"):
        RayWorkers(functools.partial(model, "llama"), num_cpus=0)


def test_workers_that_the_cluster_cannot_hold_are_refused(ray_instance):
    with pytest.raises(ValueError, match=r"num_gpus=1 need 1 GPUs, but the Ray cluster has 0"):
        RayWorkers(functools.partial(model, "llama"), num_gpus=1)
    with pytest.raises(ValueError, match=r"3 workers of num_cpus=1 need 3 CPUs, but .* has 2"):
        RayWorkers(functools.partial(model, "llama"), n_workers=3)


def test_a_saved_model_path_builds_the_same_replica(tmp_path: Path):
    model("llama").save_pretrained(tmp_path)
    source = model_source(tmp_path, pickle.dumps)
    assert source == ModelSource(None, str(tmp_path.resolve()))
    assert model_identity(source.build()) == model_identity(model("llama"))


@pytest.mark.slow
def test_replicas_with_different_weights_are_refused(ray_instance):
    unseeded = functools.partial(transformers.AutoModelForCausalLM.from_config, CONFIGS["gpt2"]())
    with pytest.raises(WorkerError, match=r"built different weights on different workers"):
        RayWorkers(unseeded, n_workers=2, num_cpus=0.5)


def test_without_ray_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(__import__("sys").modules, "ray", None)
    with pytest.raises(ImportError, match=r"pip install 'safelens\[ray\]'"):
        RayWorkers(functools.partial(model, "llama"))


def test_fingerprints_describe_values_not_addresses():
    assert describe(pair_metric) == describe(pair_metric)
    assert describe(pair_metric) != describe(other_metric)
    assert describe(functools.partial(pair_metric, 1)) != describe(
        functools.partial(pair_metric, 2)
    )
    assert "0x" not in describe(object())
    assert describe(torch.ones(2)) != describe(torch.ones(3))

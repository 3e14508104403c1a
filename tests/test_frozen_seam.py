"""A frozen `HFKeyValueCache` refuses every multi-step loop that would silently forget.

A frozen cache stores nothing. `generate` (greedy, sampled, beam; directly, through
nnsight's `LanguageModel.generate` or a bridge's `hf_generate`) decodes one token a step
and believes each step was stored, so from its second step on it would read other
numbers than `DynamicCache`. It is refused before its first step, the cache bitwise as
it was; `cache.fork()` gives `DynamicCache`'s tokens exactly. Passes whose positions
continue what the cache holds (many continuations of one prefix, the same one twice)
keep working and equal `DynamicCache`'s numbers.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import transformers
from bridge_models import bridge
from hf_models import ids, model, run, tokenizer
from packaging.version import Version
from test_hf_cache import GENERATE, assert_state, state
from transformers import DynamicCache

from safelens import CacheConfigError, FrozenCacheError
from safelens.backends.bridge._cache_pass import cache_pass
from safelens.backends.hf._cache import HFKeyValueCache
from safelens.backends.hf._model import hf_cache_argument

REFUSED = r"generate was handed a frozen cache.*cache\.fork\(\)"
# transformers >= 5.24 hands `cache.update` the pass's `position_ids`.
POSITIONS_REACH_THE_CACHE = Version(transformers.__version__) >= Version("5.24")


def prefixes(name: str, tokens: torch.Tensor) -> tuple[HFKeyValueCache, DynamicCache]:
    """A frozen safelens prefix and `DynamicCache` holding the same `tokens`."""
    lm, ours, theirs = model(name, layers=4), HFKeyValueCache(), DynamicCache()
    run(lm, tokens, ours)
    run(lm, tokens, theirs)
    ours.freeze()
    return ours, theirs


def hf_generate(lm, prompt, cache, mode: str) -> torch.Tensor:
    torch.manual_seed(11)
    return lm.generate(prompt, max_new_tokens=5, **GENERATE[mode], **{hf_cache_argument(lm): cache})


@pytest.mark.parametrize("mode", list(GENERATE))
@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma2"])
def test_generate_refuses_a_frozen_cache_and_a_fork_gives_dynamic_cache_tokens(name, mode):
    lm, prompt = model(name, layers=4), ids(1, 9)
    prefix, dynamic = prefixes(name, prompt[:, :6])
    before = state(prefix)
    with pytest.raises(FrozenCacheError, match=REFUSED):
        hf_generate(lm, prompt, prefix, mode)
    assert_state(prefix, before)
    assert not prefix._is_user_defined
    # Beam search reads one row per beam: `expand`, as `batch_repeat_interleave`.
    beams = GENERATE[mode].get("num_beams", 1)
    branch = prefix.fork() if beams == 1 else prefix.expand(beams)
    dynamic.batch_repeat_interleave(beams)
    ours = hf_generate(lm, prompt, branch, mode)
    assert torch.equal(ours, hf_generate(lm, prompt, dynamic, mode))
    assert_state(prefix, before)


@pytest.mark.parametrize("mode", ["greedy", "sampling"])
def test_nnsight_generate_refuses_a_frozen_cache_and_runs_on_a_fork(mode):
    from nnsight import TransformersModel  # LanguageModel's name since nnsight 0.8

    # A copy: nnsight's wrapper leaves its own `forward` on every module of the model.
    lm, prompt = copy.deepcopy(model("llama", layers=4)), ids(1, 9)
    wrapped = TransformersModel(lm, task="text-generation", tokenizer=tokenizer())
    prefix, dynamic = prefixes("llama", prompt[:, :6])
    before = state(prefix)
    arg = hf_cache_argument(lm)

    def traced(cache) -> torch.Tensor:
        torch.manual_seed(11)
        options = dict(max_new_tokens=5, **GENERATE[mode], **{arg: cache})
        with wrapped.generate(prompt, **options) as tracer:
            result = tracer.result.save()
        return result

    with pytest.raises(FrozenCacheError, match=REFUSED):
        traced(prefix)
    assert_state(prefix, before)
    assert torch.equal(traced(prefix.fork()), hf_generate(lm, prompt, dynamic, mode))


@pytest.mark.parametrize("mode", ["greedy", "sampling"])
def test_a_bridge_hf_generate_refuses_a_frozen_cache(mode):
    lm, prompt = bridge("llama"), ids(1, 9)
    prefix = HFKeyValueCache(naming="bridge")
    with cache_pass(lm, prefix) as argument:
        lm(prompt[:, :6], **argument)
    prefix.freeze()
    before = state(prefix)
    torch.manual_seed(11)
    # Under transformers >= 5.24 no argument reaches the bridge's attention: refused
    # before the frozen check, with the error that names run_with_hooks.
    renamed = Version(transformers.__version__) >= Version("5.24")
    error, match = (
        (CacheConfigError, "no forward argument") if renamed else (FrozenCacheError, REFUSED)
    )
    with pytest.raises(error, match=match):
        lm.hf_generate(
            prompt,
            max_new_tokens=5,
            **GENERATE[mode],
            **{hf_cache_argument(lm.original_model): prefix},
        )
    assert_state(prefix, before)


def test_passes_that_continue_the_frozen_prefix_equal_dynamic_cache():
    """Many continuations, and one twice, each at positions right after the prefix."""
    lm, tokens = model("llama", layers=4), ids(3, 10)
    prefix, dynamic = prefixes("llama", tokens[:1, :6])
    before = state(prefix)
    for row in (0, 1, 2, 0):
        continuation = tokens[row : row + 1, 6:]
        positions = torch.arange(6, 10)[None]
        ours = run(lm, continuation, prefix, position_ids=positions)
        theirs = run(lm, continuation, copy.deepcopy(dynamic), position_ids=positions)
        assert torch.equal(ours, theirs)
    assert_state(prefix, before)


def test_a_pass_past_what_a_frozen_cache_holds_is_refused_at_the_seam():
    """`update` reads the positions HuggingFace passes along (5.24+: `kwargs=`)."""
    prefix = HFKeyValueCache()
    prefix.update(torch.ones(2, 2, 6, 4), torch.ones(2, 2, 6, 4), 0)
    prefix.freeze()
    before = state(prefix)
    new = torch.zeros(2, 2, 1, 4)
    # Row 1 is left-padded by two: its positions start two lower.
    keys, _ = prefix.update(new, new, 0, kwargs={"position_ids": torch.tensor([[6], [4]])})
    assert keys.shape == (2, 2, 7, 4)
    for given in (
        {"kwargs": {"position_ids": torch.tensor([[7], [5]])}},
        {"cache_kwargs": {"cache_position": torch.tensor([7])}},
    ):
        with pytest.raises(FrozenCacheError, match=r"positions from 7 .* holding 6 positions"):
            prefix.update(new, new, 0, **given)
    with pytest.raises(FrozenCacheError, match="positions from 8"):
        prefix.update(new, new, 0, {"position_ids": torch.tensor([[8], [6]])})
    assert_state(prefix, before)
    prefix.unfreeze()  # an unfrozen cache stores each step: no check
    prefix.update(new, new, 0, kwargs={"position_ids": torch.tensor([[9], [7]])})
    assert prefix.get_seq_length() == 7


@pytest.mark.skipif(
    not POSITIONS_REACH_THE_CACHE, reason="transformers < 5.24 passes no positions to update"
)
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_hand_written_decode_loop_over_a_frozen_cache_is_refused(name):
    lm, tokens = model(name, layers=4), ids(1, 9)
    prefix, _ = prefixes(name, tokens[:, :6])
    before = state(prefix)
    run(lm, tokens[:, 6:7], prefix, position_ids=torch.tensor([[6]]))
    with pytest.raises(FrozenCacheError, match="positions from 7"):
        run(lm, tokens[:, 7:8], prefix, position_ids=torch.tensor([[7]]))
    assert_state(prefix, before)


def test_a_fork_is_independent_of_its_parent_being_unfrozen_and_refrozen():
    lm, prompt = model("llama", layers=4), ids(1, 9)
    prefix, dynamic = prefixes("llama", prompt[:, :6])
    branch = prefix.fork()
    prefix.unfreeze()
    assert torch.equal(
        hf_generate(lm, prompt, prefix, "greedy"), hf_generate(lm, prompt, dynamic, "greedy")
    )
    prefix.freeze()  # generate marked it; frozen again, it is refused again
    with pytest.raises(FrozenCacheError, match=REFUSED):
        hf_generate(lm, prompt, prefix, "greedy")
    _, fresh = prefixes("llama", prompt[:, :6])
    assert torch.equal(
        hf_generate(lm, prompt, branch, "greedy"), hf_generate(lm, prompt, fresh, "greedy")
    )


def test_threads_refused_and_served_on_one_frozen_prefix_give_the_serial_results():
    lm, prompt = model("llama", layers=4), ids(1, 9)
    prefix, dynamic = prefixes("llama", prompt[:, :6])
    before = state(prefix)
    arg = hf_cache_argument(lm)
    reference = lm.generate(prompt, max_new_tokens=5, do_sample=False, **{arg: dynamic})
    start, errors, results = threading.Barrier(2), [], []

    def refused() -> None:
        start.wait()
        for _ in range(3):
            try:
                lm.generate(prompt, max_new_tokens=5, do_sample=False, **{arg: prefix})
            except FrozenCacheError as error:
                errors.append(error)

    def served() -> None:
        start.wait()
        for _ in range(3):
            results.append(
                lm.generate(prompt, max_new_tokens=5, do_sample=False, **{arg: prefix.fork()})
            )

    threads = [threading.Thread(target=refused), threading.Thread(target=served)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(errors) == 3 and all(torch.equal(result, reference) for result in results)
    assert_state(prefix, before)

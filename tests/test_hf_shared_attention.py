"""`shared_prefix`: HF attention that reads a broadcast prefix once, against HF's own.

References are HuggingFace itself on tiny random-weight models of every family: the
same cached forward without the block (the model's own attention function, `sdpa` or
eager), and the uncached forward of prefix + continuation. Each exactness test also
checks that the shared read ran, so a silent fallback cannot pass it.
"""

from __future__ import annotations

import copy
import sys
import threading

import pytest
import torch
from hf_models import CONFIGS, ids, model, run
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface
from transformers.models.gemma2 import modeling_gemma2

import safelens.backends.hf._shared_read as read_module
from safelens import CacheConfigError, prefill, score_continuations
from safelens.backends.hf._cache import HFKeyValueCache
from safelens.backends.hf._shared_attention import shared_prefix

PREFIX, ROWS, NEW = 9, 3, 4  # past the window of 4 of Mistral and Gemma-2


@pytest.fixture
def shared_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ids of the threads that ran the shared read, one entry per attention call."""
    calls: list[int] = []
    original = read_module._shared_read

    def counted(*args, **kwargs):
        calls.append(threading.get_ident())
        return original(*args, **kwargs)

    monkeypatch.setattr(read_module, "_shared_read", counted)
    return calls


# Booting any TransformerBridge with rotary attention replaces Gemma-2's module-level
# `eager_attention_forward`, process-wide, by a `**kwargs` wrapper that fires the bridge's
# hooks; `shared_prefix` cannot see that the wrapper applies soft-capping, so it falls
# back to it (exactly; see `test_a_wrapped_eager_function_is_left_to_run`).
_BRIDGE_WRAPPER = (
    "transformer_lens.model_bridge.generalized_components.position_embeddings_attention"
)


@pytest.fixture(autouse=True)
def _gemma2_eager_unwrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma-2's own eager attention for each test, whichever bridges booted before it."""
    original = getattr(sys.modules.get(_BRIDGE_WRAPPER), "_ORIGINAL_EAGER_ATTENTION_FORWARD", None)
    if original is not None:
        monkeypatch.setattr(modeling_gemma2, "eager_attention_forward", original)


def test_a_wrapped_eager_function_is_left_to_run(monkeypatch, shared_reads):
    """A wrapper that hides whether soft-capping is applied gets the call: exact, not shared."""
    own = modeling_gemma2.eager_attention_forward
    calls: list[int] = []

    def wrapper(module, query, key, value, attention_mask, **kwargs):
        calls.append(1)
        return own(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(modeling_gemma2, "eager_attention_forward", wrapper)
    lm, prompt, rows, continuations, mask = case("gemma2")
    with torch.no_grad():
        expected = run(lm, continuations, rows, attention_mask=mask)
    calls.clear()
    with torch.no_grad(), shared_prefix(lm):
        logits = run(lm, continuations, rows, attention_mask=mask)
    assert shared_reads == [] and len(calls) == 2
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def case(name: str, dtype: torch.dtype = torch.float32, freeze: bool = True):
    """A left-padded prefix broadcast to ROWS rows, ragged continuations and their mask."""
    lm = model(name, dtype)
    prompt = ids(1, PREFIX)
    prefix_mask = torch.ones(1, PREFIX, dtype=torch.long)
    prefix_mask[0, :2] = 0
    prefix = HFKeyValueCache(lm.config)
    with torch.no_grad():
        run(lm, prompt, prefix, attention_mask=prefix_mask)
    rows = prefix.expand(ROWS)
    if freeze:
        rows.freeze()
    continuations = ids(ROWS, NEW, seed=2)
    mask = torch.cat([prefix_mask.expand(ROWS, -1), torch.ones(ROWS, NEW, dtype=torch.long)], 1)
    mask[1, -1] = 0  # a ragged (right-padded) continuation
    return lm, prompt, rows, continuations, mask


def attention_outputs(lm: torch.nn.Module, call) -> list[torch.Tensor]:
    """The output of every attention module during `call()`."""
    outputs: list[torch.Tensor] = []
    modules = [m for m in lm.modules() if type(m).__name__.endswith("Attention")]
    handles = [m.register_forward_hook(lambda _m, _i, out: outputs.append(out[0])) for m in modules]
    try:
        with torch.no_grad():
            call()
    finally:
        for handle in handles:
            handle.remove()
    assert len(outputs) == len(modules) == 2
    return outputs


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("freeze", [True, False])
def test_equals_the_models_own_attention_and_the_uncached_forward(name, freeze, shared_reads):
    lm, prompt, rows, continuations, mask = case(name, freeze=freeze)
    own = rows.fork() if not freeze else rows
    expected = attention_outputs(lm, lambda: run(lm, continuations, own, attention_mask=mask))
    logits: list[torch.Tensor] = []

    def shared_call():
        with shared_prefix(lm):
            logits.append(run(lm, continuations, rows, attention_mask=mask))

    got = attention_outputs(lm, shared_call)
    assert len(shared_reads) == 2
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        whole = torch.cat([prompt.expand(ROWS, -1), continuations], dim=1)
        uncached = run(lm, whole, attention_mask=mask)[:, PREFIX:]
    real = mask[:, PREFIX:].bool()
    torch.testing.assert_close(logits[0][real], uncached[real], atol=1e-5, rtol=1e-5)
    if not freeze:
        assert rows.get_seq_length() == PREFIX + NEW
        torch.testing.assert_close(rows.layers[1].keys, own.layers[1].keys, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_score_continuations_reads_the_prefix_shared_and_equals_the_uncached_forward(
    name, shared_reads
):
    lm, prompt = model(name), ids(1, PREFIX)[0]
    continuations = [ids(1, NEW, seed=2)[0], ids(1, 2, seed=3)[0], ids(1, NEW, seed=4)[0]]
    with torch.no_grad():
        scores = score_continuations(lm, prefill(lm, prompt), continuations).per_continuation()
        for row, got in zip(continuations, scores, strict=True):
            logits = run(lm, torch.cat([prompt, row])[None])[0, PREFIX - 1 : -1]
            expected = logits.log_softmax(-1).gather(-1, row[:, None])[:, 0]
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert len(shared_reads) == 2  # one batch, two layers


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bfloat16_equals_the_models_own_attention(name, shared_reads):
    lm, _, rows, continuations, mask = case(name, torch.bfloat16)
    expected = attention_outputs(lm, lambda: run(lm, continuations, rows, attention_mask=mask))

    def shared_call():
        with shared_prefix(lm):
            run(lm, continuations, rows, attention_mask=mask)

    got = attention_outputs(lm, shared_call)
    assert len(shared_reads) == 2
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.dtype == torch.bfloat16
        # bfloat16 keeps 8 bits: the two differ by the rounding of differently split sums.
        torch.testing.assert_close(ours, theirs, atol=2e-2, rtol=2e-2)


def test_one_new_token_without_a_mask_reads_every_position(shared_reads):
    lm = model("llama")
    prefix = HFKeyValueCache(lm.config)
    with torch.no_grad():
        run(lm, ids(1, PREFIX), prefix)
        rows = prefix.expand(ROWS)
        rows.freeze()
        token = ids(ROWS, 1, seed=3)
        expected = run(lm, token, rows)
        with shared_prefix(lm):
            got = run(lm, token, rows)
    assert len(shared_reads) == 2
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_four_dimensional_mask_changed_in_place_between_passes_is_read_afresh(shared_reads):
    lm, _, rows, continuations, _ = case("llama")
    mask = torch.ones(ROWS, 1, NEW, PREFIX + NEW, dtype=torch.bool).tril(PREFIX)
    with torch.no_grad(), shared_prefix(lm):
        first = run(lm, continuations, rows, attention_mask=mask)
        mask[:, :, :, :3] = False
        second = run(lm, continuations, rows, attention_mask=mask)
    with torch.no_grad():
        expected = run(lm, continuations, rows, attention_mask=mask)
    assert len(shared_reads) == 4 and not torch.allclose(first, second)
    torch.testing.assert_close(second, expected, atol=1e-5, rtol=1e-5)


def test_calls_it_does_not_handle_run_the_models_own_attention(shared_reads):
    lm, _, rows, continuations, mask = case("llama")
    # A copy: `output_attentions` makes transformers leave its output-capturing hooks on
    # the model for good, which other tests' checks for left-over hooks would see.
    lm = copy.deepcopy(lm)
    with torch.no_grad():
        expected = run(lm, continuations, rows, attention_mask=mask)
        with shared_prefix(lm):
            # Not broadcast: rows of storage of their own.
            run(lm, continuations, rows.select([0, 1, 2]), attention_mask=mask)
            # Attention weights asked for.
            out = run(lm, continuations, rows, attention_mask=mask, output_attentions=True)
    assert shared_reads == []
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    embeddings = lm.get_input_embeddings()(continuations).detach().requires_grad_()
    with torch.enable_grad(), shared_prefix(lm):
        # Gradients to record: the queries require them.
        run(lm, None, rows, inputs_embeds=embeddings, attention_mask=mask).sum().backward()
    assert shared_reads == [] and embeddings.grad is not None


def test_a_read_time_hook_is_applied_by_the_models_own_attention(shared_reads):
    lm, _, rows, continuations, mask = case("qwen2")
    hooks = [("model.layers.1.kv_cache.hook_v_full", lambda v, hook: v * 0)]
    with torch.no_grad():
        with rows.hooks(hooks):
            expected = run(lm, continuations, rows, attention_mask=mask)
        with shared_prefix(lm), rows.hooks(hooks):
            got = run(lm, continuations, rows, attention_mask=mask)
    assert len(shared_reads) == 1  # layer 0 only
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def registries() -> tuple[dict, dict]:
    return dict(AttentionInterface._global_mapping), dict(AttentionMaskInterface._global_mapping)


def test_config_and_registries_are_restored_on_exit_and_on_error():
    lm, gemma = model("llama"), model("gemma2")
    before = registries()
    with shared_prefix(lm), shared_prefix(gemma), shared_prefix(lm):
        assert lm.config._attn_implementation == "safelens_shared_prefix_sdpa"
        assert gemma.config._attn_implementation == "safelens_shared_prefix_eager"
    assert (lm.config._attn_implementation, gemma.config._attn_implementation) == (
        "sdpa",
        "eager",
    )
    assert registries() == before
    with pytest.raises(KeyboardInterrupt), shared_prefix(lm):
        raise KeyboardInterrupt
    assert lm.config._attn_implementation == "sdpa" and registries() == before
    assert read_module.THREAD.inside == {} and read_module.THREAD.read is None


def test_refuses_a_model_that_is_not_a_huggingface_model():
    with pytest.raises(CacheConfigError, match="model must be a HuggingFace model.*got Linear"):
        with shared_prefix(torch.nn.Linear(2, 2)):
            pass


def test_only_the_thread_inside_the_block_reads_the_prefix_shared(shared_reads):
    lm, _, rows, continuations, mask = case("mistral")
    with torch.no_grad():
        expected = run(lm, continuations, rows, attention_mask=mask)
    entered, done = threading.Event(), threading.Event()
    results: dict[str, torch.Tensor] = {}

    def inside():
        with torch.no_grad(), shared_prefix(lm):
            entered.set()
            done.wait(timeout=30)
            results["inside"] = run(lm, continuations, rows, attention_mask=mask)

    thread = threading.Thread(target=inside)
    thread.start()
    assert entered.wait(timeout=30)
    try:
        assert lm.config._attn_implementation == "safelens_shared_prefix_sdpa"
        with torch.no_grad():
            results["outside"] = run(lm, continuations, rows, attention_mask=mask)
        assert shared_reads == []  # the outside call ran while the block was held
    finally:
        done.set()
        thread.join(timeout=30)
    assert set(shared_reads) == {thread.ident} and len(shared_reads) == 2
    assert lm.config._attn_implementation == "sdpa"
    torch.testing.assert_close(results["outside"], expected, atol=0, rtol=0)
    torch.testing.assert_close(results["inside"], expected, atol=1e-5, rtol=1e-5)


def test_a_model_whose_module_branches_on_the_implementation_name_is_left_as_it_is():
    """Falcon's attention (transformers <= 5.23) picks its own branch by the name.

    Switched to the shared read's name, its eager branch would add an `sdpa` mask to its
    scores: continuations scored 2e-3 off the uncached forward. Such a model keeps its
    own attention, with the uncached forward's numbers; a stand-in module does the same
    on every transformers.
    """
    import transformers

    config = transformers.FalconConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        bos_token_id=0, eos_token_id=None, pad_token_id=None, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    falcon = transformers.AutoModelForCausalLM.from_config(config).eval()
    prompt, continuation = ids(1, PREFIX)[0], ids(1, NEW, seed=2)[0]
    with torch.no_grad():
        (got,) = score_continuations(
            falcon, prefill(falcon, prompt), [continuation]
        ).per_continuation()
        logits = run(falcon, torch.cat([prompt, continuation])[None])[0, PREFIX - 1 : -1]
    expected = logits.log_softmax(-1).gather(-1, continuation[:, None])[:, 0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    class Branching(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x if self.config._attn_implementation == "sdpa" else -x

    lm = copy.deepcopy(model("llama"))
    lm.model.layers[0].add_module("branching", Branching())
    with shared_prefix(lm):
        assert lm.config._attn_implementation == "sdpa"
    with shared_prefix(model("llama")):
        assert model("llama").config._attn_implementation == "safelens_shared_prefix_sdpa"

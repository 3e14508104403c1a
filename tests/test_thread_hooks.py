"""`hooked_anywhere`: whether a hook of the user's is attached, the libraries' own aside.

The patching sweeps run every position of every pass while one is (a hook may index
positions). What the libraries install for themselves (transformers' and the bridge's
capture hooks after a first pass, safelens' own thread hooks) does not count; a hook of
the user's on any module, on a TransformerLens hook point, or a global one does.
"""

from __future__ import annotations

import threading

import pytest
import torch
from bridge_models import bridge
from hf_models import ids, logits, model

from safelens.core._thread_hooks import hooked_anywhere, thread_hooks


def test_a_bridge_after_a_pass_has_hooks_of_its_own_only():
    lm = bridge("llama")
    lm.run_with_cache(ids(1, 4))
    assert any(m._forward_hooks or m._forward_pre_hooks for m in lm.modules())
    assert not hooked_anywhere(lm)
    lm.add_hook("blocks.1.hook_resid_pre", lambda tensor, hook: None)
    try:
        assert hooked_anywhere(lm)
    finally:
        lm.reset_hooks()
    assert not hooked_anywhere(lm)


def test_module_and_global_hooks_of_the_users_count():
    lm = model("llama")
    lm(ids(1, 4))
    assert not hooked_anywhere(lm)
    handle = lm.model.layers[1].mlp.register_forward_pre_hook(lambda module, args: None)
    assert hooked_anywhere(lm)
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        assert hooked_anywhere(lm)
    finally:
        handle.remove()
    assert not hooked_anywhere(lm)


def test_safelens_own_thread_hooks_do_not_count_and_a_users_counts_in_every_thread():
    lm = model("llama")
    seen = []

    def look() -> None:
        seen.append(hooked_anywhere(lm))

    with thread_hooks([(lm.model.layers[0], lambda tensor, hook: None)]):
        look()
        handle = lm.model.layers[0].register_forward_hook(lambda *args: None)
        other = threading.Thread(target=look)
        other.start()
        other.join()
        handle.remove()
    assert seen == [False, True]


@pytest.mark.parametrize("family", ["hf", "bridge"])
def test_another_threads_pass_while_a_hook_is_half_registered_is_plain(family, monkeypatch):
    """PyTorch registers a `with_kwargs` hook in two steps; a pass of another thread in
    between calls it without `kwargs`. At each such registration a sweep makes, another
    thread runs the model there: its logits are the plain ones, and nothing raises."""
    import safelens
    from safelens import run_with_patching_cache

    lm = model("gemma2", layers=3) if family == "hf" else bridge("llama", layers=3)
    clean, corrupted = ids(1, 6, seed=1), ids(1, 6, seed=2)
    if family == "hf":
        _, clean_cache = run_with_patching_cache(lm, clean)
    else:
        _, clean_cache = lm.run_with_cache(clean)
    probe = ids(2, 5, seed=7)
    plain = logits(lm, probe)
    sweeps = [safelens.get_act_patch_attn_head_k_by_pos, safelens.get_act_patch_resid_pre]

    def metric(logits):
        return logits[:, -1, 3] - logits[:, -1, 5]

    metric.last_position_only = True
    serial = [sweep(lm, corrupted, clean_cache, metric, progress=False) for sweep in sweeps]
    me = threading.get_ident()
    seen: list = []

    def half_registered(register, flags: str):
        def wrapper(module, hook, *args, **kwargs):
            handle = register(module, hook, *args, **kwargs)
            if kwargs.get("with_kwargs") and threading.get_ident() == me:
                del getattr(module, flags)[handle.id]  # the hook stored, its flag not yet

                def other() -> None:
                    try:
                        seen.append(logits(lm, probe))
                    except Exception as error:  # noqa: BLE001 - the assertion reports it
                        seen.append(error)

                worker = threading.Thread(target=other)
                worker.start()
                worker.join()
                getattr(module, flags)[handle.id] = True
            return handle

        return wrapper

    module = torch.nn.Module
    pre, post = module.register_forward_pre_hook, module.register_forward_hook
    monkeypatch.setattr(
        module, "register_forward_pre_hook", half_registered(pre, "_forward_pre_hooks_with_kwargs")
    )
    monkeypatch.setattr(
        module, "register_forward_hook", half_registered(post, "_forward_hooks_with_kwargs")
    )
    got = [sweep(lm, corrupted, clean_cache, metric, progress=False) for sweep in sweeps]
    monkeypatch.undo()
    assert len(seen) >= 4
    assert all(isinstance(logits, torch.Tensor) and torch.equal(logits, plain) for logits in seen)
    for swept, expected in zip(got, serial, strict=True):
        assert torch.equal(swept, expected)


def test_suspended_silences_this_threads_own_hooks_only_inside_the_block():
    from safelens.core._thread_hooks import suspended

    point = torch.nn.Identity()
    seen: list[str] = []

    def worker() -> None:  # another thread's hooks act while this one is suspended
        with thread_hooks([(point, lambda tensor, hook: seen.append("worker"))]):
            point(torch.zeros(1))

    with thread_hooks([(point, lambda tensor, hook: seen.append("main"))]):
        with suspended():
            point(torch.zeros(1))
            with suspended():
                point(torch.zeros(1))
            point(torch.zeros(1))  # the inner block restored the outer one's state
            thread = threading.Thread(target=worker)
            thread.start()
            thread.join()
        point(torch.zeros(1))
    assert seen == ["worker", "main"]

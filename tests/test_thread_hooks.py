"""`hooked_anywhere`: whether a hook of the user's is attached, the libraries' own aside.

The patching sweeps run every position of every pass while one is (a hook may index
positions). What the libraries install for themselves (transformers' and the bridge's
capture hooks after a first pass, safelens' own thread hooks) does not count; a hook of
the user's on any module, on a TransformerLens hook point, or a global one does.
"""

from __future__ import annotations

import threading

import torch
from bridge_models import bridge
from hf_models import ids, model

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

"""CacheHookPoint follows TransformerLens' HookPoint protocol."""

from __future__ import annotations

import pytest
import torch
from transformer_lens.hook_points import HookPoint

from safelens import CacheHookPoint, HookError, KeyValueCacheEntry


def _both() -> tuple[CacheHookPoint, HookPoint]:
    tl = HookPoint()
    tl.name = "blocks.0.kv_cache.hook_k_new"
    return CacheHookPoint("blocks.0.kv_cache.hook_k_new"), tl


def test_hooks_run_in_order_like_tl_hook_point() -> None:
    ours, tl = _both()
    x = torch.arange(6.0).reshape(1, 3, 1, 2)
    for point in (ours, tl):
        point.add_hook(lambda t, hook: t * 2)
        point.add_hook(lambda t, hook: None)
        point.add_hook(lambda t, hook: t + 1, prepend=True)
    torch.testing.assert_close(ours(x), tl(x), rtol=0, atol=0)


def test_hook_receives_the_point_and_its_layer() -> None:
    point = CacheHookPoint("blocks.3.kv_cache.hook_v_full")
    seen = []
    point.add_hook(lambda t, hook: seen.append((hook.name, hook.layer())))
    point(torch.zeros(1, 1, 1, 1))
    assert seen == [("blocks.3.kv_cache.hook_v_full", 3)]


def test_remove_hooks_keeps_permanent_and_other_levels() -> None:
    point = CacheHookPoint("blocks.0.kv_cache.hook_k_new")
    point.add_perma_hook(lambda t, hook: None)
    point.add_hook(lambda t, hook: None, level=1)
    point.add_hook(lambda t, hook: None, level=2)
    point.remove_hooks(level=2)
    assert [(h.is_permanent, h.level) for h in point.fwd_hooks] == [(True, None), (False, 1)]
    point.remove_hooks()
    assert point.has_hooks() and not point.has_hooks(including_permanent=False)
    point.remove_hooks(including_permanent=True)
    assert not point.has_hooks()


def test_bad_direction_and_non_callable_are_refused() -> None:
    point = CacheHookPoint("blocks.0.kv_cache.hook_k_new")
    with pytest.raises(HookError, match=r"dir must be one of \('fwd',\), got 'bwd'"):
        point.add_hook(lambda t, hook: None, dir="bwd")  # type: ignore[arg-type]
    with pytest.raises(HookError, match=r"must be callable as fn\(tensor, hook\), got int"):
        point.add_hook(3)  # type: ignore[arg-type]


def test_wrong_result_names_hook_and_expected_shape() -> None:
    point = CacheHookPoint("blocks.0.kv_cache.hook_k_new")
    point.add_hook(lambda t, hook: t[:, :1])
    with pytest.raises(
        HookError,
        match=r"'blocks\.0\.kv_cache\.hook_k_new' returned shape \(1, 1, 2, 4\).*expected "
        r"shape \(1, 3, 2, 4\) \[batch, pos, n_kv_heads, d_head\]",
    ):
        point(torch.zeros(1, 3, 2, 4))
    point.remove_hooks()
    point.add_hook(lambda t, hook: "nope")
    with pytest.raises(HookError, match=r"returned str; expected a tensor of shape"):
        point(torch.zeros(1, 3, 2, 4))


def test_entry_hooks_write_and_read_time() -> None:
    entry = KeyValueCacheEntry(torch.zeros(1, 2, 1, 2), torch.zeros(1, 2, 1, 2), layer=0)
    entry.hook_k_new.add_hook(lambda t, hook: t + 1)
    entry.hook_v_full.add_hook(lambda t, hook: t - 5)
    keys, values = entry.append(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    assert keys[:, 2].eq(1).all() and entry.keys[:, 2].eq(1).all()
    assert values.eq(-5).all() and entry.values.eq(0).all()


def test_failing_read_hook_leaves_entry_unchanged() -> None:
    entry = KeyValueCacheEntry(torch.zeros(1, 2, 1, 2), torch.zeros(1, 2, 1, 2), layer=0)
    entry.hook_k_full.add_hook(lambda t, hook: t.double())
    with pytest.raises(HookError, match="hook_k_full"):
        entry.append(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
    assert entry.sequence_length == 2 and entry.keys.eq(0).all()

"""Saving, loading and fit-checking `HFKeyValueCache` (safelens.backends.hf._persistence).

References are HuggingFace itself: a loaded prefix continues with the uncached forward's
numbers and `DynamicCache`'s, bitwise as the cache that was saved; the file's tensors
are `DynamicCache`'s. The file layer shared with `KeyValueCache` is tested in full in
test_persistence.py; here, that the HF layout goes through all its checks.
"""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from hf_models import CONFIGS, ids, model, run
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from safelens import (
    CacheConfigError,
    CacheFileError,
    CacheShapeError,
    KeyValueCache,
    KeyValueCacheEntry,
)
from safelens.backends.hf._cache import HFKeyValueCache
from safelens.backends.hf._persistence import HEAD_MAJOR
from safelens.core._persistence import save_cache


def prefilled(name: str, tokens: torch.Tensor, dtype: torch.dtype = torch.float32):
    cache = HFKeyValueCache()
    run(model(name, dtype), tokens, cache)
    return cache


def tensors(cache: HFKeyValueCache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def assert_bitwise(loaded: HFKeyValueCache, saved: HFKeyValueCache) -> None:
    pairs = list(zip(tensors(loaded), tensors(saved), strict=True))
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in pairs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_loaded_prefix_continues_with_hf_numbers(tmp_path: Path, name: str, dtype) -> None:
    lm, tokens = model(name, dtype), ids(2, 9)
    saved = prefilled(name, tokens[:, :6], dtype)
    saved.save(tmp_path / "prefix.safetensors")
    loaded = HFKeyValueCache.load(tmp_path / "prefix.safetensors")
    assert_bitwise(loaded, saved)
    loaded.check_fits(lm)
    theirs = DynamicCache(config=lm.config)
    run(lm, tokens[:, :6], theirs)
    logits = run(lm, tokens[:, 6:], loaded)
    assert torch.equal(logits, run(lm, tokens[:, 6:], saved))
    # DynamicCache evicts past a sliding window (Mistral, Gemma-2), so sums differ in rounding.
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    close = dict(atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(logits, run(lm, tokens[:, 6:], theirs), **close)
    torch.testing.assert_close(logits, run(lm, tokens)[:, 6:], **close)


def test_file_holds_dynamic_cache_tensors_and_says_what_they_are(tmp_path: Path) -> None:
    lm, tokens = model("llama"), ids(3, 7)
    cache = prefilled("llama", tokens)
    cache.freeze()
    cache.save(tmp_path / "c.safetensors")
    reference = DynamicCache(config=lm.config)
    run(lm, tokens, reference)
    saved = safetensors.torch.load_file(str(tmp_path / "c.safetensors"))
    for layer in range(2):
        assert torch.equal(saved[f"layers.{layer}.keys"], reference.layers[layer].keys)
        assert torch.equal(saved[f"layers.{layer}.values"], reference.layers[layer].values)
    with safetensors.safe_open(str(tmp_path / "c.safetensors"), "pt") as file:
        metadata = file.metadata()
    assert {key: metadata[key] for key in ("layout", "keys", "cache_class")} == {
        "layout": "head-major",
        "keys": "post-rotary",
        "cache_class": "HFKeyValueCache",
    }
    assert (metadata["format"], metadata["format_version"]) == ("safelens.kv_cache", "1")
    assert (metadata["n_layers"], metadata["n_kv_heads"], metadata["d_head"]) == ("2", "2", "8")
    assert (metadata["dtype"], metadata["sequence_length"], metadata["batch_size"]) == (
        "float32",
        "7",
        "3",
    )
    assert json.loads(metadata["has_attention_mask"]) is False
    assert json.loads(metadata["frozen"]) is True
    loaded = HFKeyValueCache.load(tmp_path / "c.safetensors", device=["cpu", "cpu"])
    assert loaded.frozen and loaded.get_seq_length() == 7 and loaded.batch_size == 3


def test_saving_changes_nothing_and_branches_save_materialised(tmp_path: Path) -> None:
    prefix = prefilled("llama", ids(1, 6))
    prefix.freeze()
    before = [t.clone() for t in tensors(prefix)]
    storages = prefix.storages()
    expanded = prefix.expand(3)
    expanded.save(tmp_path / "expanded.safetensors")
    fork = prefix.fork()
    run(model("llama"), ids(1, 2, seed=5), fork)
    fork.save(tmp_path / "fork.safetensors")
    assert HFKeyValueCache.load(tmp_path / "expanded.safetensors").batch_size == 3
    assert_bitwise(HFKeyValueCache.load(tmp_path / "fork.safetensors"), fork)
    assert all(torch.equal(a, b) for a, b in zip(tensors(prefix), before, strict=True))
    assert prefix.storages() == storages and prefix.frozen


def test_loaded_cache_takes_hooks_with_its_naming(tmp_path: Path) -> None:
    prefilled("llama", ids(1, 6)).save(tmp_path / "c.safetensors")
    loaded = HFKeyValueCache.load(tmp_path / "c.safetensors", naming="bridge")
    assert loaded.layers[1].hook_k_new.name == "blocks.1.kv_cache.hook_k_new"
    seen = []
    with loaded.hooks([("blocks.0.kv_cache.hook_k_full", lambda k, hook: seen.append(k.shape))]):
        run(model("llama"), ids(1, 2), loaded)
    assert seen == [torch.Size([1, 2, 8, 8])]
    with pytest.raises(ValueError, match="naming must be one of"):
        HFKeyValueCache.load(tmp_path / "c.safetensors", naming="tl")


# -- one backend's file is refused by the other ---------------------------------------


def test_a_file_of_the_other_backend_is_refused_saying_so(tmp_path: Path) -> None:
    keys = torch.randn(1, 5, 2, 4)
    KeyValueCache([KeyValueCacheEntry(keys, keys)]).save(tmp_path / "tl.safetensors")
    with pytest.raises(
        CacheFileError,
        match=r"holds a 'position-major' cache with 'pre-rotary' keys, saved by "
        r"'KeyValueCache'; HFKeyValueCache.load reads head-major \[batch, n_kv_heads, "
        r"pos_so_far, d_head\] tensors with post-rotary keys only.*Load it with "
        r"'KeyValueCache'.load",
    ):
        HFKeyValueCache.load(tmp_path / "tl.safetensors")
    prefilled("llama", ids(1, 5)).save(tmp_path / "hf.safetensors")
    with pytest.raises(
        CacheFileError,
        match=r"holds a 'head-major' cache with 'post-rotary' keys, saved by "
        r"'HFKeyValueCache'; KeyValueCache.load reads position-major .*Load it with "
        r"'HFKeyValueCache'.load",
    ):
        KeyValueCache.load(tmp_path / "hf.safetensors")


# -- what cannot be saved --------------------------------------------------------------


def test_save_refuses_what_it_cannot_store(tmp_path: Path) -> None:
    with pytest.raises(CacheShapeError, match="at least one layer; this cache has none"):
        HFKeyValueCache().save(tmp_path / "c")
    unreached = HFKeyValueCache(config=model("llama").config)
    unreached.update(torch.ones(1, 2, 3, 8), torch.ones(1, 2, 3, 8), 0)
    with pytest.raises(CacheShapeError, match=r"layers \[1\] hold nothing yet"):
        unreached.save(tmp_path / "c")
    gap = HFKeyValueCache()
    gap.update(torch.ones(1, 2, 3, 8), torch.ones(1, 2, 3, 8), 2)
    with pytest.raises(CacheShapeError, match=r"layers \[0, 1\] hold nothing yet"):
        gap.save(tmp_path / "c")
    assert not (tmp_path / "c").exists()


# -- corrupt, truncated and hostile files ----------------------------------------------


def small_file(tmp_path: Path) -> tuple[bytes, HFKeyValueCache]:
    generator = torch.Generator().manual_seed(0)
    cache = HFKeyValueCache()
    cache.update(*torch.randn(2, 1, 1, 2, 2, generator=generator), 0)
    cache.save(tmp_path / "small.safetensors")
    return (tmp_path / "small.safetensors").read_bytes(), cache


def loads_as_saved(path: Path, content: bytes, saved: HFKeyValueCache) -> bool:
    """Whether `content` loads bitwise as `saved`; False when it fails with CacheFileError."""
    path.write_bytes(content)
    try:
        loaded = HFKeyValueCache.load(path)
    except CacheFileError:
        return False
    assert_bitwise(loaded, saved)
    assert loaded.frozen == saved.frozen
    return True


def test_every_truncation_and_flipped_bit_fails(tmp_path: Path) -> None:
    raw, saved = small_file(tmp_path)
    assert loads_as_saved(tmp_path / "c", raw, saved)
    for length in range(len(raw)):
        assert not loads_as_saved(tmp_path / "c", raw[:length], saved)
    for position in range(len(raw)):
        changed = bytearray(raw)
        changed[position] ^= 0x01
        assert not loads_as_saved(tmp_path / "c", bytes(changed), saved)


@settings(max_examples=60, deadline=None)
@given(
    changes=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6),
    tail=st.binary(max_size=8),
)
def test_mutated_files_load_as_saved_or_fail_with_cache_file_error(
    tmp_path_factory, changes, tail
) -> None:
    folder = tmp_path_factory.mktemp("mutated")
    raw, saved = small_file(folder)
    mutated = bytearray(raw)
    for position, value in changes:
        mutated[position % len(mutated)] = value
    loads_as_saved(folder / "c", bytes(mutated) + tail, saved)


def with_header(raw: bytes, edit) -> bytes:
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + raw[8 + size :]


def test_a_header_claiming_huge_tensors_fails_in_bounded_memory(tmp_path: Path) -> None:
    raw, _ = small_file(tmp_path)

    def huge(header: dict) -> None:
        header["__metadata__"]["sequence_length"] = str(2**31 - 1)
        header["layers.0.keys"]["shape"] = [1, 1, 2**31 - 1, 2]
        header["layers.0.keys"]["data_offsets"][1] = 2**31 * 8

    (tmp_path / "huge").write_bytes(with_header(raw, huge))
    tracemalloc.start()
    try:
        with pytest.raises(CacheFileError, match="corrupt"):
            HFKeyValueCache.load(tmp_path / "huge")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak


def test_a_mask_or_a_partial_layout_record_is_refused(tmp_path: Path) -> None:
    raw, saved = small_file(tmp_path)

    def partial(header: dict) -> None:
        del header["__metadata__"]["keys"]

    (tmp_path / "partial").write_bytes(with_header(raw, partial))
    with pytest.raises(CacheFileError, match=r"has \['layout', 'cache_class'\] but not all"):
        HFKeyValueCache.load(tmp_path / "partial")
    save_cache(saved.layers, torch.ones(1, 2, dtype=torch.long), False, tmp_path / "m", HEAD_MAJOR)
    with pytest.raises(CacheFileError, match="holds an attention mask, which an HFKeyValueCache"):
        HFKeyValueCache.load(tmp_path / "m")


def test_a_header_length_starting_with_0x80_is_not_taken_for_a_pickle(tmp_path: Path) -> None:
    raw, saved = small_file(tmp_path)
    for fill in range(256):
        content = with_header(
            raw, lambda header, n=fill: header["__metadata__"].update(pad="x" * n)
        )
        if content[0] == 0x80:
            break
    assert content[0] == 0x80
    assert loads_as_saved(tmp_path / "c", content, saved)


# -- check_fits ------------------------------------------------------------------------


def test_check_fits_compares_with_the_hf_config() -> None:
    cache = prefilled("llama", ids(1, 4))
    cache.check_fits(model("llama").config)
    HFKeyValueCache(config=model("gpt2").config).check_fits(model("llama").config)
    with pytest.raises(CacheConfigError, match=r"n_kv_heads: cfg expects 4, cache has 2"):
        cache.check_fits(model("gpt2").config)
    with pytest.raises(CacheConfigError, match=r"d_head: cfg expects 16, cache has 8 \(layers"):
        cache.check_fits(type(model("llama").config)(hidden_size=64, num_attention_heads=4))
    bf16 = prefilled("llama", ids(1, 4), torch.bfloat16)
    with pytest.raises(
        CacheConfigError, match="dtype: cfg expects torch.float32, cache has torch.bf"
    ):
        bf16.check_fits(model("llama").config)
    bf16.check_fits(model("llama", torch.bfloat16))

"""Saving, loading and fit-checking caches (safelens._persistence)."""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch
from models import make_model, ones_mask, tokens

from safelens import (
    CacheConfigError,
    CacheFileError,
    CacheShapeError,
    KeyValueCache,
    KeyValueCacheEntry,
)


def _prefix(model, length: int = 6, batch: int = 1) -> KeyValueCache:
    cache = KeyValueCache.init_cache(model.cfg, "cpu", batch_size=batch)
    model(tokens(batch, length), past_kv_cache=cache, attention_mask=ones_mask(batch, length))
    return cache


def _random_cache(dtype: torch.dtype, batch: int = 2, length: int = 5) -> KeyValueCache:
    generator = torch.Generator().manual_seed(0)
    entries = [
        KeyValueCacheEntry(
            torch.randn(batch, length, 2, 4, generator=generator).to(dtype),
            torch.randn(batch, length, 2, 4, generator=generator).to(dtype),
        )
        for _ in range(3)
    ]
    mask = torch.randint(0, 2, (batch, length), generator=generator)
    return KeyValueCache(entries, mask)


def _assert_same(loaded: KeyValueCache, cache: KeyValueCache) -> None:
    assert len(loaded) == len(cache)
    for got, want in zip(loaded, cache, strict=True):
        assert got.keys.dtype == want.keys.dtype
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    assert torch.equal(loaded.previous_attention_mask, cache.previous_attention_mask)
    assert loaded.previous_attention_mask.dtype == cache.previous_attention_mask.dtype


# -- round trips ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_round_trip_is_bitwise(tmp_path: Path, dtype: torch.dtype) -> None:
    cache = _random_cache(dtype)
    cache.save(tmp_path / "cache.safetensors")
    loaded = KeyValueCache.load(tmp_path / "cache.safetensors")
    _assert_same(loaded, cache)
    assert not loaded.frozen


def test_metadata_describes_the_cache(tmp_path: Path) -> None:
    cache = _random_cache(torch.bfloat16, batch=3, length=7)
    cache.save(tmp_path / "c.safetensors")
    with safetensors.safe_open(str(tmp_path / "c.safetensors"), "pt") as file:
        metadata = file.metadata()
    assert metadata["format"] == "safelens.kv_cache"
    assert metadata["format_version"] == "1"
    assert (metadata["n_layers"], metadata["n_kv_heads"], metadata["d_head"]) == ("3", "2", "4")
    assert (metadata["dtype"], metadata["sequence_length"], metadata["batch_size"]) == (
        "bfloat16",
        "7",
        "3",
    )
    assert json.loads(metadata["has_attention_mask"]) is True
    assert json.loads(metadata["devices"]) == ["cpu", "cpu", "cpu"]


def test_cache_without_mask_round_trips(tmp_path: Path) -> None:
    cache = KeyValueCache([KeyValueCacheEntry(torch.ones(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))])
    cache.save(tmp_path / "c.safetensors")
    loaded = KeyValueCache.load(tmp_path / "c.safetensors")
    assert loaded.previous_attention_mask is None
    assert torch.equal(loaded[0].values, torch.zeros(1, 2, 2, 4))


def test_empty_init_cache_round_trips(tmp_path: Path) -> None:
    cache = KeyValueCache.init_cache(make_model().cfg, "cpu", batch_size=2)
    cache.save(tmp_path / "c.safetensors")
    loaded = KeyValueCache.load(tmp_path / "c.safetensors")
    assert loaded[1].keys.shape == (2, 0, 4, 16)
    assert loaded.previous_attention_mask.shape == (2, 0)


def test_frozen_flag_is_kept_and_saving_changes_nothing(tmp_path: Path) -> None:
    cache = _prefix(make_model("rotary"))
    cache.freeze()
    before = [entry.keys.clone() for entry in cache]
    cache.save(tmp_path / "c.safetensors")
    loaded = KeyValueCache.load(tmp_path / "c.safetensors")
    assert loaded.frozen and all(entry.frozen for entry in loaded)
    assert all(torch.equal(a, e.keys) for a, e in zip(before, cache, strict=True))
    assert cache.frozen


def test_loaded_prefix_continues_like_the_uncached_model(tmp_path: Path) -> None:
    model = make_model("rotary")
    full = tokens(1, 10)
    _prefix(model, 6).save(tmp_path / "prefix.safetensors")
    loaded = KeyValueCache.load(tmp_path / "prefix.safetensors")
    loaded.check_fits(model.cfg)
    logits = model(full[:, 6:], past_kv_cache=loaded, attention_mask=ones_mask(1, 4))
    torch.testing.assert_close(logits, model(full)[:, 6:], atol=1e-5, rtol=1e-5)


def test_expanded_and_forked_prefixes_save_materialised(tmp_path: Path) -> None:
    prefix = _prefix(make_model("rotary"))
    prefix.freeze()
    expanded = prefix.expand(3)
    expanded.save(tmp_path / "expanded.safetensors")
    loaded = KeyValueCache.load(tmp_path / "expanded.safetensors")
    assert loaded.batch_size == 3
    _assert_same(loaded, expanded)
    assert torch.equal(loaded[0].keys[2], prefix[0].keys[0])

    branch = prefix.fork()
    branch.append(0, torch.ones(1, 1, 4, 16), torch.ones(1, 1, 4, 16))
    for entry in branch.entries[1:]:
        entry.append(torch.ones(1, 1, 4, 16), torch.ones(1, 1, 4, 16))
    branch.append_attention_mask(torch.ones(1, 1, dtype=torch.long))
    branch.save(tmp_path / "branch.safetensors")
    _assert_same(KeyValueCache.load(tmp_path / "branch.safetensors"), branch)


# -- devices ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "device",
    [
        None,
        "cpu",
        torch.device("cpu"),
        ["cpu", "cpu", "cpu"],
        ("cpu",) * 3,
        {0: "cpu", 1: "cpu", 2: "cpu"},
    ],
)
def test_device_forms(tmp_path: Path, device) -> None:
    cache = _random_cache(torch.float32)
    cache.save(tmp_path / "c.safetensors")
    loaded = KeyValueCache.load(tmp_path / "c.safetensors", device=device)
    _assert_same(loaded, cache)
    assert all(entry.keys.device == torch.device("cpu") for entry in loaded)


@pytest.mark.parametrize(
    ("device", "error", "match"),
    [
        (["cpu", "cpu"], ValueError, "one device per layer: the saved cache has 3 layers, got 2"),
        ({0: "cpu", 1: "cpu"}, ValueError, r"must name every layer 0\.\.2 .* got layers \[0, 1\]"),
        ("nonsense", ValueError, "device 'nonsense' names an unknown device"),
        (3.5, TypeError, "device must be a device, a per-layer list .* got float"),
    ],
)
def test_bad_device_arguments(tmp_path: Path, device, error, match) -> None:
    _random_cache(torch.float32).save(tmp_path / "c.safetensors")
    with pytest.raises(error, match=match):
        KeyValueCache.load(tmp_path / "c.safetensors", device=device)


def test_saved_device_that_is_not_available(tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"
    _random_cache(torch.float32).save(path)
    tensors = safetensors.torch.load_file(str(path))
    with safetensors.safe_open(str(path), "pt") as file:
        metadata = file.metadata()
    metadata["devices"] = json.dumps(["cpu", "meta", "cpu"])
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)
    loaded = KeyValueCache.load(path)
    assert loaded[1].keys.device == torch.device("meta")
    assert KeyValueCache.load(path, device="cpu")[1].keys.device == torch.device("cpu")


# -- bad caches to save -----------------------------------------------------------------


def test_save_refuses_what_it_cannot_store(tmp_path: Path) -> None:
    with pytest.raises(CacheShapeError, match="at least one layer"):
        KeyValueCache().save(tmp_path / "c")
    lazy = KeyValueCache()
    lazy.append(1, torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4))
    with pytest.raises(CacheShapeError, match="layer 0 is missing"):
        lazy.save(tmp_path / "c")
    listed = KeyValueCache()
    listed.append(0, [[[1]]], [[[2]]])
    with pytest.raises(CacheShapeError, match="layer 0 keys is list"):
        listed.save(tmp_path / "c")
    uneven = KeyValueCache(
        [
            KeyValueCacheEntry(torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4)),
            KeyValueCacheEntry(torch.ones(1, 3, 2, 4), torch.ones(1, 3, 2, 4)),
        ]
    )
    with pytest.raises(CacheShapeError, match=r"layer 0 has \(1, 2, 2, 4\).*layer 1 has \(1, 3"):
        uneven.save(tmp_path / "c")
    assert not (tmp_path / "c").exists()


# -- bad files --------------------------------------------------------------------------


def _saved_bytes(tmp_path: Path) -> bytes:
    _random_cache(torch.float32).save(tmp_path / "good.safetensors")
    return (tmp_path / "good.safetensors").read_bytes()


def _header_size(raw: bytes) -> int:
    return struct.unpack("<Q", raw[:8])[0]


def _bad_files(raw: bytes) -> dict[str, tuple[bytes, str]]:
    header_end = 8 + _header_size(raw)
    flipped = bytearray(raw)
    flipped[-3] ^= 0xFF
    broken_header = bytearray(raw)
    broken_header[9] = ord("}")
    return {
        "empty": (b"", "truncated: 0 bytes"),
        "short": (raw[:5], "truncated"),
        "header cut": (raw[:40], "not a complete safetensors file"),
        "data cut": (raw[:-10], "truncated or corrupt"),
        "data only half": (raw[: header_end + 4], "truncated or corrupt"),
        "flipped data byte": (bytes(flipped), "do not match their checksum"),
        "broken header": (bytes(broken_header), "corrupt safetensors header"),
        "random": (b"\x01\x02" + bytes(range(256)) * 3, "not a complete safetensors file"),
        "text": (b"layer keys and values\n" * 10, "not a complete safetensors file"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "empty",
        "short",
        "header cut",
        "data cut",
        "data only half",
        "flipped data byte",
        "broken header",
        "random",
        "text",
    ],
)
def test_corrupt_and_truncated_files(tmp_path: Path, case: str) -> None:
    content, match = _bad_files(_saved_bytes(tmp_path))[case]
    (tmp_path / "bad").write_bytes(content)
    with pytest.raises(CacheFileError, match=match):
        KeyValueCache.load(tmp_path / "bad")


def test_foreign_safetensors_file(tmp_path: Path) -> None:
    safetensors.torch.save_file({"weight": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CacheFileError, match="safetensors file but not a safelens cache"):
        KeyValueCache.load(tmp_path / "model.safetensors")
    safetensors.torch.save_file(
        {"weight": torch.zeros(3)}, str(tmp_path / "other.safetensors"), metadata={"format": "pt"}
    )
    with pytest.raises(CacheFileError, match="no format='safelens.kv_cache' marker"):
        KeyValueCache.load(tmp_path / "other.safetensors")


class _Trap:
    def __reduce__(self):
        return (Path.touch, (Path(self.target),))

    def __init__(self, target: str) -> None:
        self.target = target


def test_pickles_are_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    (tmp_path / "cache.pkl").write_bytes(pickle.dumps(_Trap(str(marker))))
    with pytest.raises(CacheFileError, match="is a pickle file.*never unpickles"):
        KeyValueCache.load(tmp_path / "cache.pkl")
    torch.save({"keys": _Trap(str(marker))}, tmp_path / "cache.pt")
    with pytest.raises(CacheFileError, match="zip archive .*torch.save"):
        KeyValueCache.load(tmp_path / "cache.pt")
    assert not marker.exists()


def _rewrite_metadata(path: Path, **changes: str) -> None:
    tensors = safetensors.torch.load_file(str(path))
    with safetensors.safe_open(str(path), "pt") as file:
        metadata = file.metadata()
    metadata.update(changes)
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)


def test_unknown_version(tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"
    _random_cache(torch.float32).save(path)
    _rewrite_metadata(path, format_version="2")
    with pytest.raises(CacheFileError, match="format version '2'; this safelens reads version 1"):
        KeyValueCache.load(path)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"n_layers": "4"}, "corrupt: it holds tensors"),
        ({"d_head": "5"}, r"layers.0.keys has shape \(2, 5, 2, 4\).*\(2, 5, 2, 5\)"),
        ({"dtype": "float16"}, "metadata says .* torch.float16"),
        ({"n_kv_heads": "two"}, "corrupt safelens metadata"),
        ({"has_attention_mask": "false"}, "corrupt: it holds tensors"),
    ],
)
def test_metadata_that_disagrees_with_the_tensors(tmp_path: Path, changes, match) -> None:
    path = tmp_path / "c.safetensors"
    _random_cache(torch.float32).save(path)
    _rewrite_metadata(path, **changes)
    with pytest.raises(CacheFileError, match=match):
        KeyValueCache.load(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no cache file at"):
        KeyValueCache.load(tmp_path / "nothing.safetensors")


# -- check_fits -------------------------------------------------------------------------


def test_check_fits_accepts_the_model_it_was_made_with() -> None:
    model = make_model("rotary", n_kv_heads=2)
    _prefix(model).check_fits(model.cfg)


@pytest.mark.parametrize(
    ("other", "match"),
    [
        (dict(n_layers=3), "layers: cfg expects 3, cache has 2"),
        (dict(n_kv_heads=2), r"n_kv_heads: cfg expects 2, cache has 4 \(layers \[0, 1\]\)"),
        (dict(d_model=128), "d_head: cfg expects 32, cache has 16"),
        (dict(dtype=torch.float64), "dtype: cfg expects torch.float64, cache has torch.float32"),
    ],
)
def test_check_fits_names_each_mismatch(other, match) -> None:
    cache = _prefix(make_model("rotary"))
    with pytest.raises(CacheConfigError, match=match):
        cache.check_fits(make_model("rotary", **other).cfg)


def test_check_fits_lists_all_mismatches_and_non_tensor_layers() -> None:
    cache = KeyValueCache()
    cache.append(0, [[[1]]], [[[2]]])
    with pytest.raises(CacheConfigError, match="layers: cfg expects 2, cache has 1; layout"):
        cache.check_fits(make_model().cfg)

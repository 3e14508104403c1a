"""Saving, loading and fit-checking caches (safelens.core._persistence)."""

from __future__ import annotations

import errno
import json
import os
import pickle
import struct
import tempfile
import tracemalloc
from pathlib import Path

import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
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
        ("nonsense", ValueError, "device='nonsense' names an unknown device .*such as 'cpu'"),
        (["cpu", "gpu7", "cpu"], ValueError, r"device\[1\]='gpu7' names an unknown device"),
        ({0: "cpu", 1: "cpu", 2: None}, ValueError, r"device\[2\]=None names an unknown device"),
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
    uneven = KeyValueCache()
    uneven.append(0, torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4))
    uneven.append(1, torch.ones(1, 3, 2, 4), torch.ones(1, 3, 2, 4))
    with pytest.raises(CacheShapeError, match=r"layer 0 has \(1, 2, 2, 4\).*layer 1 has \(1, 3"):
        uneven.save(tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_save_into_a_missing_directory_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "missing" / "prefix.safetensors"
    with pytest.raises(
        FileNotFoundError, match=f"directory {tmp_path / 'missing'} does not ex"
    ) as raised:
        _random_cache(torch.float32).save(path)
    assert raised.value.filename == str(path) and ".tmp" not in str(raised.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("failure", "match"),
    [
        (
            OSError(errno.ENOSPC, "No space left on device"),
            "cannot save the cache \\(No space left",
        ),
        (KeyboardInterrupt(), None),
    ],
)
def test_failed_save_keeps_the_old_file_and_leaves_no_temporary(
    tmp_path: Path, monkeypatch, failure: BaseException, match: str | None
) -> None:
    path = tmp_path / "prefix.safetensors"
    _random_cache(torch.float32).save(path)
    before = path.read_bytes()

    def fail(source, target) -> None:
        raise failure

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(type(failure), match=match) as raised:
        _random_cache(torch.float64).save(path)
    assert getattr(raised.value, "filename", str(path)) == str(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["prefix.safetensors"]


def test_save_onto_a_directory_names_the_path(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    with pytest.raises(IsADirectoryError) as raised:
        _random_cache(torch.float32).save(tmp_path / "taken")
    assert raised.value.filename == str(tmp_path / "taken")
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]


def test_saved_file_is_plain_safetensors(tmp_path: Path) -> None:
    cache = _random_cache(torch.bfloat16)
    cache.save(tmp_path / "c.safetensors")
    tensors = safetensors.torch.load_file(str(tmp_path / "c.safetensors"))
    assert torch.equal(tensors["layers.2.values"], cache[2].values)
    assert torch.equal(tensors["attention_mask"], cache.previous_attention_mask)
    assert _header_size((tmp_path / "c.safetensors").read_bytes()) % 8 == 0


# -- hostile files ----------------------------------------------------------------------
#
# Each case is a file built by hand (struct + json) or cut from a real saved file. Every
# one must fail with CacheFileError, whatever its header claims.


def _saved_bytes(tmp_path: Path) -> bytes:
    _random_cache(torch.float32).save(tmp_path / "good.safetensors")
    return (tmp_path / "good.safetensors").read_bytes()


def _header_size(raw: bytes) -> int:
    return struct.unpack("<Q", raw[:8])[0]


def _split(raw: bytes) -> tuple[dict, bytes]:
    """A saved file's header (as JSON) and data section."""
    end = 8 + _header_size(raw)
    return json.loads(raw[8:end]), raw[end:]


def _file(header: dict | bytes, data: bytes = b"", announced: int | None = None) -> bytes:
    """A safetensors file from a header (a dict, or raw header bytes) and data bytes."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if announced is None else announced) + raw + data


def _load_bytes(tmp_path: Path, content: bytes) -> KeyValueCache:
    (tmp_path / "bad").write_bytes(content)
    return KeyValueCache.load(tmp_path / "bad")


def _bad_files(raw: bytes) -> dict[str, tuple[bytes, str]]:
    header_end = 8 + _header_size(raw)
    flipped = bytearray(raw)
    flipped[-3] ^= 0xFF
    broken_header = bytearray(raw)
    broken_header[9] = ord("}")
    header, data = _split(raw)
    complete = "not a complete safetensors file"
    return {
        "empty": (b"", "truncated: 0 bytes"),
        "short": (raw[:5], "truncated"),
        "header cut": (raw[:40], complete),
        "data cut": (raw[:-10], "truncated or corrupt: its header describes"),
        "data only half": (raw[: header_end + 4], "truncated or corrupt"),
        "trailing bytes": (raw + b"\0" * 8, "truncated or corrupt: its header describes"),
        "flipped data byte": (bytes(flipped), "do not match their checksum"),
        "broken header": (bytes(broken_header), "corrupt safetensors header"),
        "random": (b"\x01\x02" + bytes(range(256)) * 3, complete),
        "text": (b"layer keys and values\n" * 10, complete),
        "header longer than the file": (struct.pack("<Q", len(raw) - 7) + raw[8:], complete),
        "header length 2**64 - 1": (_file(header, data, announced=2**64 - 1), complete),
        "header over 256 KiB": (_file(b" " * ((1 << 18) + 8)), "more than the 262144 bytes"),
        "header not utf-8": (_file(b"{\xff\xfe}"), "corrupt safetensors header: 'utf-8'"),
        "header a list": (_file(b"[1, 2]"), r"corrupt safetensors header: not a JSON object"),
        "arrays 100000 deep": (_file(b"[" * 100_000), "nests too deeply"),
        "objects 50000 deep": (_file(b'{"a":' * 50_000), "nests too deeply"),
        "closed nesting 100000 deep": (_file(b"[" * 100_000 + b"]" * 100_000), "nests too deep"),
        "duplicate tensor": (
            raw[:8] + raw[8:header_end].replace(b'"layers.1.keys"', b'"layers.0.keys"') + data,
            "the key 'layers.0.keys' appears twice",
        ),
        "huge integer": (_file(b'{"a": ' + b"9" * 5000 + b"}"), "corrupt safetensors header"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "empty",
        "short",
        "header cut",
        "data cut",
        "data only half",
        "trailing bytes",
        "flipped data byte",
        "broken header",
        "random",
        "text",
        "header longer than the file",
        "header length 2**64 - 1",
        "header over 256 KiB",
        "header not utf-8",
        "header a list",
        "arrays 100000 deep",
        "objects 50000 deep",
        "closed nesting 100000 deep",
        "duplicate tensor",
        "huge integer",
    ],
)
def test_corrupt_and_truncated_files(tmp_path: Path, case: str) -> None:
    content, match = _bad_files(_saved_bytes(tmp_path))[case]
    with pytest.raises(CacheFileError, match=match):
        _load_bytes(tmp_path, content)


def _keys(**changes) -> dict:
    """Layer 0's keys entry in the header of `_saved_bytes`, with `changes`."""
    return {"dtype": "F32", "shape": [2, 5, 2, 4], "data_offsets": [0, 320], **changes}


_ENTRY = "corrupt safetensors header: tensor 'layers.0.keys'"
_OFFSETS = f"{_ENTRY} has data_offsets .*; expected \\[begin, end\\], two ints"
_MALFORMED = {
    "entry not an object": (5, f"{_ENTRY} needs dtype, shape and data_offsets, got 5"),
    "no data_offsets": ({"dtype": "F32", "shape": [2, 5, 2, 4]}, f"{_ENTRY} needs dtype, shape"),
    "extra field": (_keys(extra=1), f"{_ENTRY} needs dtype, shape and data_offsets, got {{"),
    "unknown dtype": (_keys(dtype="F128"), f"{_ENTRY} has dtype 'F128'; expected one of \\['F64'"),
    "dtype a number": (_keys(dtype=32), f"{_ENTRY} has dtype 32"),
    "complex dtype": (_keys(dtype="C64"), f"{_ENTRY} has dtype 'C64'"),
    "shape a string": (
        _keys(shape="2, 5, 2, 4"),
        f"{_ENTRY} has shape '2, 5, 2, 4'; expected a list",
    ),
    "negative size": (_keys(shape=[2, -5, 2, 4]), f"{_ENTRY} has shape \\[2, -5, 2, 4\\]"),
    "bool size": (_keys(shape=[2, True, 2, 4]), f"{_ENTRY} has shape \\[2, True, 2, 4\\]"),
    "float size": (_keys(shape=[2, 5.0, 2, 4]), f"{_ENTRY} has shape \\[2, 5.0, 2, 4\\]"),
    "string size": (_keys(shape=[2, "5", 2, 4]), f"{_ENTRY} has shape \\[2, '5', 2, 4\\]"),
    "rank 5": (_keys(shape=[2, 5, 2, 4, 1]), f"{_ENTRY} has shape .*at most 4 sizes"),
    "rank 10000": (
        _keys(shape=[1] * 10_000),
        f"{_ENTRY} has shape \\[1, 1, 1, 1, 1, 1, \\.\\.\\.\\]",
    ),
    "size 2**40": (_keys(shape=[2**40, 5, 2, 4]), f"{_ENTRY} has shape .*from 0 to 2147483647"),
    "shape null": (_keys(shape=None), f"{_ENTRY} has shape None"),
    "one offset": (_keys(data_offsets=[0]), _OFFSETS),
    "three offsets": (_keys(data_offsets=[0, 160, 320]), _OFFSETS),
    "string offsets": (_keys(data_offsets=["0", "320"]), _OFFSETS),
    "float offsets": (_keys(data_offsets=[0.0, 320.0]), _OFFSETS),
    "bool offset": (_keys(data_offsets=[False, 320]), _OFFSETS),
    "reversed offsets": (_keys(data_offsets=[320, 0]), _OFFSETS),
    "negative offset": (_keys(data_offsets=[-320, 0]), _OFFSETS),
    "offsets null": (_keys(data_offsets=None), _OFFSETS),
    "offsets an object": (_keys(data_offsets={"begin": 0, "end": 320}), _OFFSETS),
    "too few bytes": (
        _keys(data_offsets=[0, 160]),
        f"{_ENTRY} has data_offsets \\[0, 160\\] \\(160 bytes\\), but F32 of shape "
        "\\(2, 5, 2, 4\\) takes 320 bytes",
    ),
    "dtype of another size": (_keys(dtype="F16"), "but F16 of shape \\(2, 5, 2, 4\\) takes 160 b"),
    "huge shape": (_keys(shape=[2**31 - 1] * 4), f"takes {(2**31 - 1) ** 4 * 4} bytes"),
    "offsets past the file": (
        _keys(data_offsets=[10**30, 10**30 + 320]),
        "'layers.0.values' starts at byte 320 of the data, where the tensors before it end at 0",
    ),
    "overlapping": (_keys(data_offsets=[160, 480]), "starts at byte 160 .*overlap or leave a gap"),
    "same bytes twice": (_keys(data_offsets=[320, 640]), "'layers.0.keys' starts at byte 320"),
}


@pytest.mark.parametrize("case", list(_MALFORMED))
def test_malformed_tensor_entries(tmp_path: Path, case: str) -> None:
    header, data = _split(_saved_bytes(tmp_path))
    assert header["layers.0.keys"] == _keys()
    header["layers.0.keys"], match = _MALFORMED[case]
    with pytest.raises(CacheFileError, match=match):
        _load_bytes(tmp_path, _file(header, data))


def test_tensors_overlapping_a_neighbour(tmp_path: Path) -> None:
    header, data = _split(_saved_bytes(tmp_path))
    header["layers.0.values"]["data_offsets"] = [160, 480]
    with pytest.raises(CacheFileError, match="'layers.0.values' starts at byte 160 .* end at 320"):
        _load_bytes(tmp_path, _file(header, data))


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


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no cache file at"):
        KeyValueCache.load(tmp_path / "nothing.safetensors")


_NAMES = [f"layers.{layer}.{kind}" for layer in range(3) for kind in ("keys", "values")]
_NAMES.append("attention_mask")


def _with_metadata(raw: bytes, **changes) -> bytes:
    """`raw` with metadata fields replaced (or removed where the change is `None`)."""
    header, data = _split(raw)
    for name, value in changes.items():
        if value is None:
            del header["__metadata__"][name]
        else:
            header["__metadata__"][name] = value
    return _file(header, data)


_WHOLE = "expected a whole number from 0 to 2147483647"
_HOLDS_7 = "but it holds 7 tensors: \\['attention_mask', 'layers.0.keys'"
_METADATA = {
    "n_layers 1e9": (
        {"n_layers": "1000000000"},
        f"describes 1000000000 layers \\(two tensors each\\) and an attention mask, {_HOLDS_7}",
    ),
    "n_layers 4": ({"n_layers": "4"}, f"describes 4 layers .*{_HOLDS_7}"),
    "n_layers 2": ({"n_layers": "2"}, f"describes 2 layers .*{_HOLDS_7}"),
    "n_layers 0": ({"n_layers": "0"}, f"describes 0 layers .*{_HOLDS_7}"),
    "n_layers negative": ({"n_layers": "-1"}, f"n_layers='-1'; {_WHOLE}"),
    "n_layers fraction": ({"n_layers": "1.5"}, f"n_layers='1.5'; {_WHOLE}"),
    "n_layers with a space": ({"n_layers": " 3"}, f"n_layers=' 3'; {_WHOLE}"),
    "n_layers with a sign": ({"n_layers": "+3"}, f"n_layers='\\+3'; {_WHOLE}"),
    "n_layers in hex": ({"n_layers": "0x3"}, f"n_layers='0x3'; {_WHOLE}"),
    "n_layers in Arabic digits": ({"n_layers": "\u0663"}, f"n_layers='\u0663'; {_WHOLE}"),
    "n_layers empty": ({"n_layers": ""}, f"n_layers=''; {_WHOLE}"),
    "n_layers 2**64": ({"n_layers": str(2**64)}, f"n_layers='18446744073709551616'; {_WHOLE}"),
    "n_layers 5000 digits": ({"n_layers": "9" * 5000}, f"n_layers='9999.*'; {_WHOLE}"),
    "n_layers a number": ({"n_layers": 3}, "corrupt safelens metadata: 'n_layers' is int, not a"),
    "n_layers a list": ({"n_layers": [3]}, "'n_layers' is list, not a string"),
    "batch_size 2**32": ({"batch_size": "4294967296"}, f"batch_size='4294967296'; {_WHOLE}"),
    "batch_size wrong": (
        {"batch_size": "3"},
        "layers.0.keys has shape \\(2, 5, 2, 4\\) .*metadata says \\(3, 5, 2, 4\\)",
    ),
    "sequence_length negative": ({"sequence_length": "-5"}, f"sequence_length='-5'; {_WHOLE}"),
    "sequence_length huge": (
        {"sequence_length": "2147483647"},
        "metadata says \\(2, 2147483647, 2, 4\\)",
    ),
    "n_kv_heads a word": ({"n_kv_heads": "two"}, f"n_kv_heads='two'; {_WHOLE}"),
    "d_head a float": ({"d_head": "4.0"}, f"d_head='4.0'; {_WHOLE}"),
    "d_head wrong": ({"d_head": "5"}, "layers.0.keys has shape \\(2, 5, 2, 4\\).*\\(2, 5, 2, 5\\)"),
    "has_attention_mask yes": (
        {"has_attention_mask": "yes"},
        "has_attention_mask='yes'; expected 'true' or 'false'",
    ),
    "has_attention_mask false": (
        {"has_attention_mask": "false"},
        f"describes 3 layers .*{_HOLDS_7}",
    ),
    "frozen 1": ({"frozen": "1"}, "frozen='1'; expected 'true' or 'false'"),
    "dtype unknown": ({"dtype": "float128"}, "dtype='float128' is not a dtype"),
    "dtype not a dtype": ({"dtype": "Tensor"}, "dtype='Tensor' is not a dtype"),
    "dtype of other tensors": ({"dtype": "float16"}, "metadata says .* torch.float16"),
    "devices not JSON": ({"devices": "cpu, cpu"}, "devices='cpu, cpu' is not valid JSON"),
    "devices 100000 deep": ({"devices": "[" * 100_000}, "devices='\\[\\[\\[.*' is not valid JSON"),
    "devices a string": ({"devices": '"cpu"'}, "devices='cpu'; expected a list of 3 device names"),
    "devices too few": ({"devices": '["cpu"]'}, "devices=\\['cpu'\\]; expected a list of 3 device"),
    "device a number": ({"devices": '["cpu", 5, "cpu"]'}, "puts layer 1 on 5, which is not a"),
    "device bogus": (
        {"devices": '["cpu", "gpu7", "cpu"]'},
        "puts layer 1 on 'gpu7', which is not a device torch knows \\(.*\\)\\. Re-save",
    ),
    "device index negative": ({"devices": '["cpu", "cpu", "cuda:-1"]'}, "puts layer 2 on 'cu"),
    "mask_device null": (
        {"mask_device": "null"},
        "mask_device=None while has_attention_mask is true",
    ),
    "mask_device bogus": ({"mask_device": '"tpu"'}, "puts the mask on 'tpu', which is not a dev"),
    "checksums a list": ({"checksums": "[]"}, "checksums=\\[\\]; expected one checksum string"),
    "checksums empty": ({"checksums": "{}"}, "checksums={}; expected one checksum string per"),
    "checksums numbers": (
        {"checksums": json.dumps({n: 0 for n in _NAMES})},
        "checksums=.*; expected one checksum string per tensor",
    ),
    "checksum wrong": (
        {"checksums": json.dumps({n: "00000000" for n in _NAMES})},
        "the bytes of layers.0.keys do not match their checksum",
    ),
    "format_version 2": (
        {"format_version": "2"},
        "format version '2'; this safelens reads version 1",
    ),
    "format_version missing": ({"format_version": None}, "format version None; this"),
    "format other": ({"format": "pt"}, "no format='safelens.kv_cache' marker"),
    "format missing": ({"format": None}, "no format='safelens.kv_cache' marker"),
    **{
        f"{name} missing": ({name: None}, f"corrupt safelens metadata: it has no '{name}' field")
        for name in (
            "n_layers",
            "n_kv_heads",
            "d_head",
            "dtype",
            "sequence_length",
            "batch_size",
            "has_attention_mask",
            "frozen",
            "devices",
            "mask_device",
            "checksums",
        )
    },
}


@pytest.mark.parametrize("case", list(_METADATA))
def test_hostile_metadata(tmp_path: Path, case: str) -> None:
    changes, match = _METADATA[case]
    with pytest.raises(CacheFileError, match=match):
        _load_bytes(tmp_path, _with_metadata(_saved_bytes(tmp_path), **changes))


def _renamed(raw: bytes, old: str, new: str) -> bytes:
    header, data = _split(raw)
    header = {new if name == old else name: info for name, info in header.items()}
    return _file(header, data)


def _without_mask(raw: bytes) -> bytes:
    header, data = _split(raw)
    begin, end = header.pop("attention_mask")["data_offsets"]
    assert end == len(data)
    return _file(header, data[:begin])


def _with_extra_tensor(raw: bytes) -> bytes:
    header, data = _split(raw)
    header["layers.3.keys"] = {"dtype": "F32", "shape": [0], "data_offsets": [len(data)] * 2}
    return _file(header, data)


def _float_mask(raw: bytes) -> bytes:
    header, data = _split(raw)
    header["attention_mask"]["dtype"] = "F64"  # same bytes, so the checksum still holds
    return _file(header, data)


def test_tensor_names_that_disagree_with_the_metadata(tmp_path: Path) -> None:
    raw = _saved_bytes(tmp_path)
    holds = "is corrupt: it holds tensors \\[{}\\] that its metadata does not describe, and lacks"
    cases = [
        (_renamed(raw, "layers.2.values", "layers.5.values"), holds.format("'layers.5.values'")),
        (_renamed(raw, "layers.0.keys", "layers.00.keys"), holds.format("'layers.00.keys'")),
        (
            _renamed(raw, "attention_mask", "mask"),
            holds.format("'mask'") + " \\['attention_mask'\\]",
        ),
        (_without_mask(raw), "describes 3 layers .* and an attention mask, but it holds 6"),
        (_with_extra_tensor(raw), "describes 3 layers .* but it holds 8 tensors"),
        (_float_mask(raw), "does not hold a valid cache: previous_attention_mask must hold int"),
    ]
    for content, match in cases:
        with pytest.raises(CacheFileError, match=match):
            _load_bytes(tmp_path, content)


def test_a_billion_layers_claimed_by_a_tiny_file_fail_before_any_allocation(
    tmp_path: Path,
) -> None:
    cache = KeyValueCache([KeyValueCacheEntry(torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4))])
    cache.save(tmp_path / "c.safetensors")
    claims = [  # (metadata changes, message, bound on the Python memory a load may use)
        ({"n_layers": "1000000000"}, "describes 1000000000 layers", 1_000_000),
        ({"sequence_length": "2147483647"}, "metadata says \\(1, 2147483647, 2, 4\\)", 1_000_000),
        ({"devices": json.dumps(["cpu"] * 25_000)}, "expected a list of 1 device", 50_000_000),
    ]
    for changes, match, bound in claims:
        content = _with_metadata((tmp_path / "c.safetensors").read_bytes(), **changes)
        tracemalloc.start()
        try:
            with pytest.raises(CacheFileError, match=match):
                _load_bytes(tmp_path, content)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        # The messages show each check fired on the header, before any tensor buffer.
        assert peak < bound, (changes, len(content), peak)
    assert len(_with_metadata((tmp_path / "c.safetensors").read_bytes(), **claims[0][0])) < 1500


@pytest.mark.parametrize("element", [b"[]", b"{}", b"[[]]", b'"ab"', b"1.5"])
def test_the_largest_header_parses_in_bounded_memory(tmp_path: Path, element: bytes) -> None:
    items = b",".join([element] * ((1 << 18) // (len(element) + 1) - 8))
    content = _file(b'{"a":[' + items + b"]}")
    assert len(content) <= 8 + (1 << 18)
    tracemalloc.start()
    try:
        with pytest.raises(CacheFileError, match="not a safelens cache: its metadata has no"):
            _load_bytes(tmp_path, content)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12_000_000, peak


def _small_cache() -> KeyValueCache:
    generator = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 1, 2, 1, 2, generator=generator)
    return KeyValueCache([KeyValueCacheEntry(keys, values)], torch.ones(1, 2, dtype=torch.long))


def _small_file() -> bytes:
    with tempfile.TemporaryDirectory() as folder:
        _small_cache().save(Path(folder) / "c.safetensors")
        return (Path(folder) / "c.safetensors").read_bytes()


def _loads_as_saved_or_fails_cleanly(path: Path, content: bytes, saved: KeyValueCache) -> bool:
    """Whether `content` loaded as `saved`; False when it failed with CacheFileError."""
    path.write_bytes(content)
    try:
        loaded = KeyValueCache.load(path)
    except CacheFileError:
        return False
    _assert_same(loaded, saved)
    assert loaded.frozen == saved.frozen
    return True


def test_every_truncation_fails(tmp_path: Path) -> None:
    raw, saved = _small_file(), _small_cache()
    for length in range(len(raw)):
        assert not _loads_as_saved_or_fails_cleanly(tmp_path / "c", raw[:length], saved)


def test_every_flipped_bit_fails(tmp_path: Path) -> None:
    raw, saved = _small_file(), _small_cache()
    for position in range(len(raw)):
        for flip in (0x01, 0x20):  # a digit, letter or quote to its neighbour; case; space
            changed = bytearray(raw)
            changed[position] ^= flip
            assert not _loads_as_saved_or_fails_cleanly(tmp_path / "c", bytes(changed), saved)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=8),
    st.one_of(st.none(), st.integers(0, 10**6)),
    st.binary(max_size=16),
)
def test_mutated_files_load_as_saved_or_fail_with_cache_file_error(
    tmp_path_factory, changes, cut, tail
) -> None:
    raw = bytearray(_SMALL)
    for position, value in changes:
        raw[position % len(raw)] = value
    content = bytes(raw[: cut % (len(raw) + 1)] if cut is not None else raw) + tail
    path = tmp_path_factory.mktemp("mutated") / "c.safetensors"
    _loads_as_saved_or_fails_cleanly(path, content, _small_cache())


_SMALL = _small_file()


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

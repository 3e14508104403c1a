"""Saving and loading caches in safetensors files, and checking a cache fits a model.

A saved cache is one [safetensors](https://huggingface.co/docs/safetensors) file: the
tensors `layers.{l}.keys` and `layers.{l}.values` (`[batch, pos_so_far, n_kv_heads,
d_head]`, pre-rotary keys as TransformerLens stores them) and, when the cache has one,
`attention_mask` (`[batch, pos_so_far]`). Its metadata holds the format marker, the
format version, `n_layers`, `n_kv_heads`, `d_head`, `dtype`, `sequence_length`,
`batch_size`, whether there is an attention mask, the frozen flag, each layer's device
and a CRC-32 checksum of every tensor.

Loading never executes code: the header is read as JSON and the tensors as raw bytes
(no pickle, no `torch.load`). A file that is truncated, corrupt, foreign (no safelens
marker, a pickle or `torch.save` file, random bytes) or of an unknown format version
fails with [`CacheFileError`][safelens.CacheFileError] before any tensor is built.

Caveat: the file holds the materialised keys and values. A cache made by
`prefix.expand(n)` is saved with all `n` rows, and a fork with its whole prefix, so the
storage sharing of branches is not kept on disk; save the prefix itself to store it once.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Mapping
from collections.abc import Sequence as SequenceOf
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from safetensors.torch import load_file, save_file

from ._cache_entry import KeyValueCacheEntry
from ._config import CacheDimensions, parse_dtype
from ._errors import CacheConfigError, CacheFileError, CacheShapeError

if TYPE_CHECKING:
    from ._cache import KeyValueCache

__all__ = ["FORMAT", "FORMAT_VERSION", "save_cache", "load_cache", "check_fits"]

FORMAT = "safelens.kv_cache"
FORMAT_VERSION = 1
_MASK = "attention_mask"
_HEADER_BYTES = 8
_MAX_HEADER = 100_000_000
_NOT_SAFETENSORS = (
    (b"\x80", "a pickle file"),
    (b"PK\x03\x04", "a zip archive (torch.save writes these; they hold pickles)"),
)

CacheT = TypeVar("CacheT", bound="KeyValueCache")
Devices = torch.device | str | SequenceOf[torch.device | str] | Mapping[int, torch.device | str]


def _keys_name(layer: int) -> str:
    return f"layers.{layer}.keys"


def _values_name(layer: int) -> str:
    return f"layers.{layer}.values"


def _checksum(tensor: torch.Tensor) -> str:
    raw = tensor.reshape(-1).view(torch.uint8).numpy()
    return f"{zlib.crc32(raw.data):08x}"


# -- saving ---------------------------------------------------------------------------


def _layer_tensors(cache: KeyValueCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    entries = cache.entries
    if not entries:
        raise CacheShapeError("save needs a cache with at least one layer; this cache has none")
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for position, entry in enumerate(entries):
        if entry.layer != position:
            raise CacheShapeError(
                f"save needs layers 0..{len(entries) - 1} filled; layer {position} is "
                f"missing (the cache holds layers {[e.layer for e in entries]})"
            )
        keys, values = entry.keys, entry.values
        for name, value in (("keys", keys), ("values", values)):
            if not isinstance(value, torch.Tensor) or value.dim() != 4:
                raise CacheShapeError(
                    f"save needs [batch, pos_so_far, n_kv_heads, d_head] tensors; layer "
                    f"{position} {name} is {type(value).__name__} of shape "
                    f"{getattr(value, 'shape', None)}"
                )
        if keys.shape != values.shape or keys.dtype != values.dtype:
            raise CacheShapeError(
                f"save needs keys and values of one shape and dtype; layer {position} has "
                f"keys {tuple(keys.shape)} {keys.dtype}, values {tuple(values.shape)} "
                f"{values.dtype}"
            )
        first = pairs[0][0] if pairs else keys
        if keys.shape != first.shape or keys.dtype != first.dtype:
            raise CacheShapeError(
                f"save needs every layer to have one shape and dtype; layer 0 has "
                f"{tuple(first.shape)} {first.dtype}, layer {position} has "
                f"{tuple(keys.shape)} {keys.dtype}"
            )
        pairs.append((keys, values))
    return pairs


def save_cache(cache: KeyValueCache, path: str | PathLike[str]) -> None:
    """Write `cache` to a safetensors file at `path` (see the module docstring)."""
    pairs = _layer_tensors(cache)
    mask = cache.previous_attention_mask
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
        raise CacheShapeError(
            f"save needs a [batch, pos_so_far] tensor attention mask or none; the cache "
            f"holds {type(mask).__name__} of shape {getattr(mask, 'shape', None)}"
        )
    keys = pairs[0][0]
    batch, length, n_kv_heads, d_head = keys.shape
    tensors: dict[str, torch.Tensor] = {}
    for layer, (layer_keys, layer_values) in enumerate(pairs):
        tensors[_keys_name(layer)] = layer_keys
        tensors[_values_name(layer)] = layer_values
    if mask is not None:
        tensors[_MASK] = mask
    # Own contiguous CPU copies: expanded rows are materialised, shared storage split.
    tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}
    metadata = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "n_layers": str(len(pairs)),
        "n_kv_heads": str(n_kv_heads),
        "d_head": str(d_head),
        "dtype": str(keys.dtype).removeprefix("torch."),
        "sequence_length": str(length),
        "batch_size": str(batch),
        "has_attention_mask": json.dumps(mask is not None),
        "frozen": json.dumps(bool(cache.frozen)),
        "devices": json.dumps([str(k.device) for k, _ in pairs]),
        "mask_device": json.dumps(None if mask is None else str(mask.device)),
        "checksums": json.dumps({name: _checksum(t) for name, t in tensors.items()}),
    }
    save_file(tensors, str(path), metadata=metadata)


# -- loading --------------------------------------------------------------------------


def _read_header(path: Path) -> dict[str, Any]:
    """The safetensors JSON header, checked to be a complete file; never runs code."""
    size = path.stat().st_size
    with path.open("rb") as file:
        start = file.read(_HEADER_BYTES)
        for signature, kind in _NOT_SAFETENSORS:
            if start.startswith(signature):
                raise CacheFileError(
                    f"{path} is {kind}, not a safetensors cache file; safelens never "
                    "unpickles files (that can run code). Save caches with cache.save(path)"
                )
        if len(start) < _HEADER_BYTES:
            raise CacheFileError(
                f"{path} is truncated: {size} bytes, shorter than a safetensors header"
            )
        (header_size,) = struct.unpack("<Q", start)
        if header_size > _MAX_HEADER or _HEADER_BYTES + header_size > size:
            raise CacheFileError(
                f"{path} is not a complete safetensors file: its first bytes announce a "
                f"{header_size}-byte header but the file has {size} bytes (truncated, "
                "corrupt or not a safetensors file)"
            )
        raw = file.read(header_size)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CacheFileError(f"{path} has a corrupt safetensors header: {error}") from None
    if not isinstance(header, dict):
        raise CacheFileError(f"{path} has a corrupt safetensors header (not a JSON object)")
    ends = [
        info.get("data_offsets", [0, 0])[-1]
        for name, info in header.items()
        if name != "__metadata__" and isinstance(info, dict)
    ]
    if not all(isinstance(end, int) for end in ends):
        raise CacheFileError(f"{path} has a corrupt safetensors header (bad data_offsets)")
    data_size = max(ends, default=0)
    if _HEADER_BYTES + header_size + data_size != size:
        raise CacheFileError(
            f"{path} is truncated or corrupt: its header describes "
            f"{_HEADER_BYTES + header_size + data_size} bytes, the file has {size}"
        )
    return header


def _metadata(path: Path, header: dict[str, Any]) -> dict[str, Any]:
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise CacheFileError(
            f"{path} is a safetensors file but not a safelens cache: its metadata has no "
            f"format={FORMAT!r} marker. Only files written by KeyValueCache.save load"
        )
    version = metadata.get("format_version")
    if version != str(FORMAT_VERSION):
        raise CacheFileError(
            f"{path} is a safelens cache of format version {version!r}; this safelens "
            f"reads version {FORMAT_VERSION!r}. Load it with the safelens that wrote it"
        )
    try:
        return {
            "n_layers": int(metadata["n_layers"]),
            "n_kv_heads": int(metadata["n_kv_heads"]),
            "d_head": int(metadata["d_head"]),
            "dtype": parse_dtype(metadata["dtype"]),
            "sequence_length": int(metadata["sequence_length"]),
            "batch_size": int(metadata["batch_size"]),
            "has_attention_mask": bool(json.loads(metadata["has_attention_mask"])),
            "frozen": bool(json.loads(metadata["frozen"])),
            "devices": list(json.loads(metadata["devices"])),
            "mask_device": json.loads(metadata["mask_device"]),
            "checksums": dict(json.loads(metadata["checksums"])),
        }
    except (KeyError, ValueError, TypeError, CacheConfigError) as error:
        raise CacheFileError(f"{path} has corrupt safelens metadata: {error!r}") from None


def _check_tensors(path: Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    expected = {_keys_name(layer) for layer in range(meta["n_layers"])}
    expected |= {_values_name(layer) for layer in range(meta["n_layers"])}
    if meta["has_attention_mask"]:
        expected.add(_MASK)
    if set(tensors) != expected or len(meta["devices"]) != meta["n_layers"]:
        raise CacheFileError(
            f"{path} is corrupt: it holds tensors {sorted(tensors)}, its metadata "
            f"describes {sorted(expected)}"
        )
    shape = (meta["batch_size"], meta["sequence_length"], meta["n_kv_heads"], meta["d_head"])
    for name, tensor in tensors.items():
        want = shape[:2] if name == _MASK else shape
        if tuple(tensor.shape) != want or (name != _MASK and tensor.dtype != meta["dtype"]):
            raise CacheFileError(
                f"{path} is corrupt: {name} has shape {tuple(tensor.shape)} and dtype "
                f"{tensor.dtype}; its metadata says {want} and {meta['dtype']}"
            )
        if _checksum(tensor) != meta["checksums"].get(name):
            raise CacheFileError(
                f"{path} is corrupt: the bytes of {name} do not match their checksum"
            )


def _target_devices(devices: Devices | None, meta: dict[str, Any]) -> list[torch.device]:
    n_layers = meta["n_layers"]
    if devices is None:
        chosen: list[Any] = meta["devices"]
    elif isinstance(devices, (str, torch.device)):
        chosen = [devices] * n_layers
    elif isinstance(devices, Mapping):
        if set(devices) != set(range(n_layers)):
            raise ValueError(
                f"device as a mapping must name every layer 0..{n_layers - 1} of the "
                f"saved cache, got layers {sorted(devices)}"
            )
        chosen = [devices[layer] for layer in range(n_layers)]
    elif isinstance(devices, SequenceOf):
        if len(devices) != n_layers:
            raise ValueError(
                f"device as a list must give one device per layer: the saved cache has "
                f"{n_layers} layers, got {len(devices)} devices"
            )
        chosen = list(devices)
    else:
        raise TypeError(
            "device must be a device, a per-layer list of devices or a {layer: device} "
            f"mapping, got {type(devices).__name__}"
        )
    try:
        return [torch.device(d) for d in chosen]
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device {devices!r} names an unknown device: {error}") from None


def _moved(tensor: torch.Tensor, device: torch.device, what: str) -> torch.Tensor:
    try:
        return tensor.to(device)
    except (RuntimeError, AssertionError) as error:
        raise CacheFileError(
            f"cannot put the saved {what} on {device}: {error}. Pass device='cpu' (or a "
            "per-layer list) to KeyValueCache.load"
        ) from None


def load_cache(
    cls: type[CacheT], path: str | PathLike[str], device: Devices | None = None
) -> CacheT:
    """Read a cache written by [`save_cache`][] (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no cache file at {path}")
    meta = _metadata(path, _read_header(path))
    try:
        tensors = load_file(str(path), device="cpu")
    except Exception as error:  # safetensors raises its own SafetensorError
        raise CacheFileError(f"{path} is corrupt: safetensors cannot read it: {error}") from None
    _check_tensors(path, meta, tensors)
    devices = _target_devices(device, meta)
    entries = [
        KeyValueCacheEntry(
            _moved(tensors[_keys_name(layer)], devices[layer], f"layer {layer} keys"),
            _moved(tensors[_values_name(layer)], devices[layer], f"layer {layer} values"),
        )
        for layer in range(meta["n_layers"])
    ]
    mask = None
    if meta["has_attention_mask"]:
        mask_device = devices[0] if device is not None else meta["mask_device"]
        mask = _moved(tensors[_MASK], torch.device(mask_device), "attention mask")
    return cls(entries, mask, frozen=meta["frozen"])


# -- checking -------------------------------------------------------------------------


def check_fits(cache: KeyValueCache, cfg: Any) -> None:
    """Raise `CacheConfigError` listing every way `cache` does not fit model `cfg`."""
    dims = CacheDimensions.of(cfg)
    problems = []
    if len(cache) != dims.n_layers:
        problems.append(f"layers: cfg expects {dims.n_layers}, cache has {len(cache)}")
    mismatches: dict[tuple[str, str, str], list[int | None]] = {}
    for entry in cache.entries:
        keys = entry.keys
        if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
            found = f"{type(keys).__name__} of shape {getattr(keys, 'shape', None)}"
            key = ("layout", "[batch, pos_so_far, n_kv_heads, d_head] tensors", found)
            mismatches.setdefault(key, []).append(entry.layer)
            continue
        found_sizes: list[tuple[str, object]] = [
            ("n_kv_heads", keys.shape[2]),
            ("d_head", keys.shape[3]),
            ("dtype", keys.dtype),
        ]
        for name, value in found_sizes:
            wanted = getattr(dims, name)
            if value != wanted:
                mismatches.setdefault((name, str(wanted), str(value)), []).append(entry.layer)
    for (name, wanted, found), layers in mismatches.items():
        problems.append(f"{name}: cfg expects {wanted}, cache has {found} (layers {layers})")
    if problems:
        raise CacheConfigError(
            "the cache does not fit the model config: " + "; ".join(problems) + ". This "
            "usually means the cache was made for another model"
        )

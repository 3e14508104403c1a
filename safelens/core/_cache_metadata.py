"""The metadata of a saved cache file, and the checks that read it back.

A file written by `save_cache` (`safelens.core._persistence`) names its tensors
`layers.{l}.keys`, `layers.{l}.values` and `attention_mask`, and its safetensors metadata
holds the format marker and version, the layout, the sizes, the dtype, the frozen flag,
each layer's device and every tensor's CRC-32 checksum. `checked_layout` checks each
field's type and range and the tensor names, shapes and dtype they imply against the
tensors the file really holds, before any tensor is read, and says what it found in a
`SavedLayout`.

Caveat: a file written before the layout was recorded has no `layout`, `keys` or
`cache_class` field; it is read as a position-major, pre-rotary `KeyValueCache` file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ._config import parse_dtype
from ._errors import CacheConfigError, CacheFileError
from ._safetensors_file import MAX_SIZE, Span, shown, tensor_spans
from ._tensor_layout import TensorLayout

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MASK",
    "SavedLayout",
    "checked_layout",
    "keys_name",
    "values_name",
]

FORMAT = "safelens.kv_cache"
FORMAT_VERSION = 1
MASK = "attention_mask"
# Files saved before the layout was recorded are KeyValueCache's.
_OLDEST_LAYOUT = {"layout": "position-major", "keys": "pre-rotary", "cache_class": "KeyValueCache"}


def keys_name(layer: int) -> str:
    return f"layers.{layer}.keys"


def values_name(layer: int) -> str:
    return f"layers.{layer}.values"


@dataclass(frozen=True)
class SavedLayout:
    """What a checked header says about the cache in the file."""

    spans: dict[str, Span]
    n_layers: int
    frozen: bool
    devices: list[torch.device]
    mask_device: torch.device | None
    checksums: dict[str, str]


def _bad_metadata(path: Path, what: str) -> CacheFileError:
    return CacheFileError(
        f"{path} has corrupt safelens metadata: {what}. Re-save the cache with cache.save(path)"
    )


def _check_marker(path: Path, header: dict[str, Any]) -> dict[str, str]:
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise CacheFileError(
            f"{path} is a safetensors file but not a safelens cache: its metadata has no "
            f"format={FORMAT!r} marker. Only files written by KeyValueCache.save load"
        )
    version = metadata.get("format_version")
    if version != str(FORMAT_VERSION):
        raise CacheFileError(
            f"{path} is a safelens cache of format version {shown(version)}; this safelens "
            f"reads version {FORMAT_VERSION!r}. Load it with the safelens that wrote it"
        )
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise _bad_metadata(path, f"{shown(key)} is {type(value).__name__}, not a string")
    return metadata


def _field(path: Path, metadata: dict[str, str], name: str) -> str:
    if name not in metadata:
        raise _bad_metadata(path, f"it has no {name!r} field")
    return metadata[name]


def _count(path: Path, metadata: dict[str, str], name: str) -> int:
    value = _field(path, metadata, name)
    if not (len(value) <= 10 and value.isascii() and value.isdigit() and int(value) <= MAX_SIZE):
        raise _bad_metadata(
            path, f"{name}={shown(value)}; expected a whole number from 0 to {MAX_SIZE}"
        )
    return int(value)


def _json_field(path: Path, metadata: dict[str, str], name: str) -> Any:
    value = _field(path, metadata, name)
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        raise _bad_metadata(path, f"{name}={shown(value)} is not valid JSON") from None


def _flag(path: Path, metadata: dict[str, str], name: str) -> bool:
    value = _field(path, metadata, name)
    if value not in ("true", "false"):
        raise _bad_metadata(path, f"{name}={shown(value)}; expected 'true' or 'false'")
    return value == "true"


def _saved_device(path: Path, name: object, what: str) -> torch.device:
    try:
        if not isinstance(name, str):
            raise TypeError(f"a device name is a string, not {type(name).__name__}")
        return torch.device(name)
    except (RuntimeError, TypeError, ValueError) as error:
        raise _bad_metadata(
            path, f"it puts {what} on {shown(name)}, which is not a device torch knows ({error})"
        ) from None


def _check_tensor_layout(path: Path, metadata: dict[str, str], layout: TensorLayout) -> None:
    """Refuse a file whose tensors are in another layout than `layout`, naming its reader."""
    present = [name for name in _OLDEST_LAYOUT if name in metadata]
    if present and len(present) < len(_OLDEST_LAYOUT):
        raise _bad_metadata(path, f"it has {present} but not all of {list(_OLDEST_LAYOUT)}")
    found = [metadata.get(name, default) for name, default in _OLDEST_LAYOUT.items()]
    if found != [layout.name, layout.keys, layout.cache_class]:
        name, keys, cache_class = map(shown, found)
        raise CacheFileError(
            f"{path} holds a {name} cache with {keys} keys, saved by {cache_class}; "
            f"{layout.cache_class}.load reads {layout.described} only, and the other "
            f"layout's keys mean something else to the model. Load it with {cache_class}.load"
        )


def checked_layout(
    path: Path, header: dict[str, Any], data_start: int, size: int, layout: TensorLayout
) -> SavedLayout:
    """Check every metadata field against the tensors the file really holds."""
    metadata = _check_marker(path, header)
    _check_tensor_layout(path, metadata, layout)
    spans = tensor_spans(path, header, data_start, size)
    n_layers = _count(path, metadata, "n_layers")
    has_mask = _flag(path, metadata, "has_attention_mask")
    if n_layers == 0 or 2 * n_layers + has_mask != len(spans):
        raise CacheFileError(
            f"{path} is corrupt: its metadata describes {n_layers} layers (two tensors each)"
            f"{' and an attention mask' if has_mask else ''}, but it holds {len(spans)} "
            f"tensors: {shown(sorted(spans))}"
        )
    names = [name for layer in range(n_layers) for name in (keys_name(layer), values_name(layer))]
    names += [MASK] if has_mask else []
    unexpected, missing = sorted(set(spans) - set(names)), sorted(set(names) - set(spans))
    if unexpected or missing:
        raise CacheFileError(
            f"{path} is corrupt: it holds tensors {shown(unexpected)} that its metadata does "
            f"not describe, and lacks {shown(missing)}"
        )
    batch, length = _count(path, metadata, "batch_size"), _count(path, metadata, "sequence_length")
    heads, d_head = _count(path, metadata, "n_kv_heads"), _count(path, metadata, "d_head")
    shape = layout.arrange(
        {"batch": batch, "pos_so_far": length, "n_kv_heads": heads, "d_head": d_head}
    )
    try:
        dtype = parse_dtype(_field(path, metadata, "dtype"))
    except CacheConfigError:
        raise _bad_metadata(path, f"dtype={shown(metadata['dtype'])} is not a dtype") from None
    for name, span in spans.items():
        want = (batch, length) if name == MASK else shape
        if span.shape != want or (name != MASK and span.dtype != dtype):
            raise CacheFileError(
                f"{path} is corrupt: {name} has shape {span.shape} and dtype "
                f"{span.dtype}; its metadata says {want} and {dtype}"
            )
    devices = _json_field(path, metadata, "devices")
    if not isinstance(devices, list) or len(devices) != n_layers:
        raise _bad_metadata(
            path, f"devices={shown(devices)}; expected a list of {n_layers} device names"
        )
    mask_device = _json_field(path, metadata, "mask_device")
    if has_mask != (mask_device is not None):
        raise _bad_metadata(
            path,
            f"mask_device={shown(mask_device)} while has_attention_mask is "
            f"{json.dumps(has_mask)}; a mask has a device, and no mask none",
        )
    checksums = _json_field(path, metadata, "checksums")
    if (
        not isinstance(checksums, dict)
        or set(checksums) != set(spans)
        or not all(isinstance(value, str) for value in checksums.values())
    ):
        raise _bad_metadata(
            path, f"checksums={shown(checksums)}; expected one checksum string per tensor"
        )
    return SavedLayout(
        spans=spans,
        n_layers=n_layers,
        frozen=_flag(path, metadata, "frozen"),
        devices=[_saved_device(path, d, f"layer {layer}") for layer, d in enumerate(devices)],
        mask_device=None if mask_device is None else _saved_device(path, mask_device, "the mask"),
        checksums=checksums,
    )

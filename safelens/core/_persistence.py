"""Saving and loading caches in safetensors files: `save_cache` and `load_cache`.

A saved cache is one [safetensors](https://huggingface.co/docs/safetensors) file: the
tensors `layers.{l}.keys` and `layers.{l}.values` in the layout of the cache that saved
them (a `TensorLayout`: `[batch, pos_so_far, n_kv_heads, d_head]` pre-rotary keys for
`KeyValueCache`, as TransformerLens stores them) and, when the cache has one,
`attention_mask` (`[batch, pos_so_far]`). Its metadata holds the format marker, the
format version, the layout (`layout`, `keys`, `cache_class`; files without them are
position-major), `n_layers`, `n_kv_heads`, `d_head`, `dtype`, `sequence_length`,
`batch_size`, whether there is an attention mask, the frozen flag, each layer's device
and a CRC-32 checksum of every tensor. A file of another layout is refused, naming the
class that reads it. Saving writes a temporary file beside `path` and
renames it onto `path`, so a failed save leaves any earlier file whole.

The file layer (atomic writes, a strict reader that checks the header's dtypes, shapes
and byte ranges against the file size before allocating anything, and never unpickles)
is `_safetensors_file`. On top of it, loading checks every metadata field's type and
range and the tensor names, shapes and dtype the metadata implies (`_cache_metadata`),
and each tensor's checksum. So a file that is truncated, corrupt, hostile, foreign (no safelens marker, a
pickle or `torch.save` file, random bytes) or of an unknown format version fails with
[`CacheFileError`][safelens.CacheFileError] in time and memory bounded by its own size,
whatever its header says.

Caveat: the file holds the materialised keys and values. A cache made by
`prefix.expand(n)` is saved with all `n` rows, and a fork with its whole prefix, so the
storage sharing of branches is not kept on disk; save the prefix itself to store it once.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable, Mapping
from collections.abc import Sequence as SequenceOf
from io import BufferedReader
from os import PathLike
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from ._cache_metadata import (
    FORMAT,
    FORMAT_VERSION,
    MASK,
    SavedLayout,
    checked_layout,
    keys_name,
    values_name,
)
from ._errors import CacheFileError, CacheShapeError
from ._safetensors_file import (
    DTYPE_CODES,
    bytes_of,
    read_header,
    read_tensor,
    write_safetensors,
)
from ._tensor_layout import POSITION_MAJOR, TensorLayout

__all__ = ["save_cache", "load_cache"]

CacheT = TypeVar("CacheT")
Devices = torch.device | str | SequenceOf[torch.device | str] | Mapping[int, torch.device | str]
Pairs = list[tuple[torch.Tensor, torch.Tensor]]


class CachedLayer(Protocol):
    """What saving reads of a layer: its index and its keys and values."""

    @property
    def layer(self) -> int | None: ...
    @property
    def keys(self) -> Any: ...
    @property
    def values(self) -> Any: ...


def _checksum(raw: memoryview) -> str:
    return f"{zlib.crc32(raw):08x}"


# -- saving ---------------------------------------------------------------------------


def _layer_tensors(entries: SequenceOf[CachedLayer], layout: TensorLayout) -> Pairs:
    if not entries:
        raise CacheShapeError("save needs a cache with at least one layer; this cache has none")
    pairs: Pairs = []
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
                    f"save needs {layout.shape} tensors; layer "
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


def save_cache(
    entries: SequenceOf[CachedLayer],
    mask: Any,
    frozen: bool,
    path: str | PathLike[str],
    layout: TensorLayout = POSITION_MAJOR,
) -> None:
    """Write a cache's layer `entries` (in order, tensors in `layout`), `mask` and `frozen` flag.

    See the module docstring for the file.
    """
    path = Path(path)
    pairs = _layer_tensors(entries, layout)
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
        raise CacheShapeError(
            f"save needs a [batch, pos_so_far] tensor attention mask or none; the cache "
            f"holds {type(mask).__name__} of shape {getattr(mask, 'shape', None)}"
        )
    keys = pairs[0][0]
    sizes = layout.sizes(tuple(keys.shape))
    tensors: dict[str, torch.Tensor] = {}
    for layer, (layer_keys, layer_values) in enumerate(pairs):
        tensors[keys_name(layer)] = layer_keys
        tensors[values_name(layer)] = layer_values
    if mask is not None:
        tensors[MASK] = mask
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPE_CODES:
            raise CacheShapeError(
                f"save cannot store {name} of dtype {tensor.dtype}; a cache file holds "
                f"{', '.join(str(dtype) for dtype in DTYPE_CODES)}"
            )
    # Own contiguous CPU copies: expanded rows are materialised, shared storage split.
    tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}
    metadata = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "layout": layout.name,
        "keys": layout.keys,
        "cache_class": layout.cache_class,
        "n_layers": str(len(pairs)),
        "n_kv_heads": str(sizes["n_kv_heads"]),
        "d_head": str(sizes["d_head"]),
        "dtype": str(keys.dtype).removeprefix("torch."),
        "sequence_length": str(sizes["pos_so_far"]),
        "batch_size": str(sizes["batch"]),
        "has_attention_mask": json.dumps(mask is not None),
        "frozen": json.dumps(bool(frozen)),
        "devices": json.dumps([str(k.device) for k, _ in pairs]),
        "mask_device": json.dumps(None if mask is None else str(mask.device)),
        "checksums": json.dumps({name: _checksum(bytes_of(t)) for name, t in tensors.items()}),
    }
    write_safetensors(path, tensors, metadata)


# -- loading --------------------------------------------------------------------------


def _read_tensors(
    path: Path, file: BufferedReader, data_start: int, layout: SavedLayout
) -> dict[str, torch.Tensor]:
    """Each tensor read into its own buffer of its checked size, and its checksum checked."""
    tensors = {}
    for name, span in layout.spans.items():
        tensor = read_tensor(path, file, data_start, name, span)
        if _checksum(bytes_of(tensor)) != layout.checksums[name]:
            raise CacheFileError(
                f"{path} is corrupt: the bytes of {name} do not match their checksum"
            )
        tensors[name] = tensor
    return tensors


def _device_argument(value: object, name: str) -> torch.device:
    try:
        return torch.device(value)  # type: ignore[call-overload]
    except (RuntimeError, TypeError, ValueError) as error:
        raise ValueError(
            f"{name}={value!r} names an unknown device ({error}); pass a torch.device or a "
            "name such as 'cpu' or 'cuda:0'"
        ) from None


def _target_devices(devices: Devices | None, layout: SavedLayout) -> list[torch.device]:
    n_layers = layout.n_layers
    if devices is None:
        return layout.devices
    if isinstance(devices, (str, torch.device)):
        return [_device_argument(devices, "device")] * n_layers
    if isinstance(devices, Mapping):
        if set(devices) != set(range(n_layers)):
            raise ValueError(
                f"device as a mapping must name every layer 0..{n_layers - 1} of the "
                f"saved cache, got layers {sorted(devices, key=repr)}"
            )
    elif isinstance(devices, SequenceOf):
        if len(devices) != n_layers:
            raise ValueError(
                f"device as a list must give one device per layer: the saved cache has "
                f"{n_layers} layers, got {len(devices)} devices"
            )
    else:
        raise TypeError(
            "device must be a device, a per-layer list of devices or a {layer: device} "
            f"mapping, got {type(devices).__name__}"
        )
    return [_device_argument(devices[layer], f"device[{layer}]") for layer in range(n_layers)]


def _moved(tensor: torch.Tensor, device: torch.device, what: str, reader: str) -> torch.Tensor:
    try:
        return tensor.to(device)
    except (RuntimeError, AssertionError) as error:
        raise CacheFileError(
            f"cannot put the saved {what} on {device}: {error}. Pass device='cpu' (or a "
            f"per-layer list) to {reader}.load"
        ) from None


def load_cache(
    build: Callable[[Pairs, torch.Tensor | None, bool], CacheT],
    path: str | PathLike[str],
    device: Devices | None = None,
    layout: TensorLayout = POSITION_MAJOR,
) -> CacheT:
    """Read a cache of `layout` written by `save_cache`, made by `build(pairs, mask, frozen)`.

    `pairs` holds each layer's `(keys, values)` in `layout`. See the module docstring for
    the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no cache file at {path}")
    with path.open("rb") as file:
        size = os.fstat(file.fileno()).st_size
        header, data_start = read_header(path, file, size)
        saved = checked_layout(path, header, data_start, size, layout)
        devices = _target_devices(device, saved)
        tensors = _read_tensors(path, file, data_start, saved)
    reader = layout.cache_class
    pairs = [
        (
            _moved(tensors[keys_name(layer)], devices[layer], f"layer {layer} keys", reader),
            _moved(tensors[values_name(layer)], devices[layer], f"layer {layer} values", reader),
        )
        for layer in range(saved.n_layers)
    ]
    mask = None
    if MASK in tensors:
        mask_device = devices[0] if device is not None else saved.mask_device
        assert mask_device is not None  # _layout pairs a mask with its device
        mask = _moved(tensors[MASK], mask_device, "attention mask", reader)
    try:  # the containers check what they hold, e.g. that a mask is integer
        return build(pairs, mask, saved.frozen)
    except CacheShapeError as error:
        raise CacheFileError(f"{path} does not hold a valid cache: {error}") from None

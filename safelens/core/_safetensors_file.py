"""Reading and writing safetensors files safely, in memory bounded by the file's size.

A [safetensors](https://huggingface.co/docs/safetensors) file is an 8-byte little-endian
header length, a JSON header (padded to 8-byte alignment) and a data section. The header
maps each tensor's name to its dtype code, shape and `[begin, end]` byte range in the
data section, plus a `__metadata__` object of string pairs. This module writes such files
atomically (a temporary file beside the target, renamed onto it, so a failed write leaves
any earlier file whole) and reads them without executing code: the header is parsed as
JSON and each tensor read as raw bytes (no pickle, no `torch.load`).

It is a strict reader. Everything the header claims is checked against the file size
before anything is allocated: the header takes at most 256 KiB, has no duplicate keys, and
every tensor has a known dtype, a shape of at most four sizes below 2**31, and a byte range
of exactly the size its dtype and shape need; the ranges tile the data section with no
gap or overlap and end where the file ends. A truncated, corrupt or hostile file, or a
pickle or `torch.save` file, fails with [`CacheFileError`][safelens.CacheFileError]
whatever its header says, and each tensor is read into a buffer of its checked size.

Caveat: the format checks structure only. The metadata is not checksummed, and neither
are the tensor bytes; what the metadata means, and any checksum of the tensors, is for
the caller to check (safelens caches keep a CRC-32 of every tensor in their metadata).
"""

from __future__ import annotations

import errno
import json
import math
import os
import reprlib
import struct
import tempfile
from collections.abc import Iterable
from io import BufferedReader
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ._errors import CacheFileError, CacheShapeError

__all__ = [
    "MAX_SIZE",
    "DTYPE_CODES",
    "Span",
    "bytes_of",
    "shown",
    "write_safetensors",
    "read_header",
    "tensor_spans",
    "read_tensor",
]

_HEADER_BYTES = 8
# A cache header takes about 250 bytes per layer, so 256 KiB holds 1000 layers; the
# objects JSON makes of 256 KiB take under about 10 MB, whatever the header holds.
_MAX_HEADER = 1 << 18
MAX_SIZE = 2**31 - 1  # bound on every saved size: batch, positions, heads, d_head
_NOT_SAFETENSORS = (
    (b"\x80", "a pickle file"),
    (b"PK\x03\x04", "a zip archive (torch.save writes these; they hold pickles)"),
)
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_CODES = {dtype: code for code, dtype in _DTYPES.items()}
"""The safetensors code of every dtype a file can hold."""


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def shown(value: object) -> str:
    """A repr of something read from a file, cut short whatever its size."""
    return reprlib.repr(value)


# -- writing --------------------------------------------------------------------------


def _write_replacing(path: Path, chunks: Iterable[bytes | memoryview]) -> None:
    """Write `chunks` to a temporary file beside `path`, then rename it onto `path`."""
    if not path.parent.is_dir():
        raise FileNotFoundError(
            errno.ENOENT,
            f"cannot save the cache: the directory {path.parent} does not exist; create it "
            "first, e.g. with Path(path).parent.mkdir(parents=True)",
            str(path),
        )
    temporary: str | None = None
    try:
        with tempfile.NamedTemporaryFile(
            "wb", dir=path.parent, prefix=".safelens-", suffix=".tmp", delete=False
        ) as file:
            temporary = file.name
            for chunk in chunks:
                file.write(chunk)
        os.replace(temporary, path)
    except BaseException as error:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise OSError(
                error.errno,
                f"cannot save the cache ({error.strerror}); nothing was written and any "
                "file already there is unchanged",
                str(path),
            ) from None
        raise


def write_safetensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> None:
    """Write contiguous CPU `tensors` and `metadata` as a safetensors file at `path`.

    Every dtype must be in `DTYPE_CODES`. Raises `CacheShapeError` when the header would
    exceed what `read_header` accepts, `FileNotFoundError` when the directory of `path`
    does not exist, and `OSError` naming `path` when writing fails (any file already at
    `path` is then unchanged).
    """
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, tensor in tensors.items():
        end = offset + tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": DTYPE_CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8-byte alignment
    if len(raw) > _MAX_HEADER:
        raise CacheShapeError(
            f"save cannot write {len(tensors)} tensors in one file: its header would take "
            f"{len(raw)} bytes, more than the {_MAX_HEADER} bytes load accepts"
        )
    _write_replacing(path, [struct.pack("<Q", len(raw)), raw, *map(bytes_of, tensors.values())])


# -- reading --------------------------------------------------------------------------


class Span(NamedTuple):
    """One tensor as the header describes it: dtype, shape and byte range."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _corrupt(path: Path, what: str) -> CacheFileError:
    return CacheFileError(f"{path} has a corrupt safetensors header: {what}")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise ValueError(f"the key {shown(key)} appears twice")
        found[key] = value
    return found


def read_header(path: Path, file: BufferedReader, size: int) -> tuple[dict[str, Any], int]:
    """The safetensors JSON header and where the data starts; never runs code.

    `file` is `path` opened for reading at its start, and `size` its size in bytes.
    Raises `CacheFileError` for a pickle or zip file, a header longer than the file or
    than 256 KiB, or a header that is not a JSON object with unique keys.
    """
    start = file.read(_HEADER_BYTES)
    # A header length can start with a signature's bytes too (0x80 is 128); a JSON header
    # then follows, where a pickle or zip file has other bytes.
    for signature, kind in _NOT_SAFETENSORS:
        if start.startswith(signature) and file.peek(1)[:1] != b"{":
            raise CacheFileError(
                f"{path} is {kind}, not a safetensors cache file; safelens never "
                "unpickles files (that can run code). Save caches with cache.save(path)"
            )
    if len(start) < _HEADER_BYTES:
        raise CacheFileError(
            f"{path} is truncated: {size} bytes, shorter than a safetensors header"
        )
    (header_size,) = struct.unpack("<Q", start)
    if _HEADER_BYTES + header_size > size:
        raise CacheFileError(
            f"{path} is not a complete safetensors file: its first bytes announce a "
            f"{header_size}-byte header but the file has {size} bytes (truncated, "
            "corrupt or not a safetensors file)"
        )
    if header_size > _MAX_HEADER:
        raise CacheFileError(
            f"{path} is not a safelens cache: its first bytes announce a {header_size}-byte "
            f"header, more than the {_MAX_HEADER} bytes a cache header can take"
        )
    try:
        header = json.loads(file.read(header_size).decode(), object_pairs_hook=_unique_keys)
    except RecursionError:
        raise _corrupt(path, "its JSON nests too deeply (a cache header nests 3 levels)") from None
    except ValueError as error:  # includes UnicodeDecodeError and JSONDecodeError
        raise _corrupt(path, str(error)) from None
    if not isinstance(header, dict):
        raise _corrupt(path, "not a JSON object")
    return header, _HEADER_BYTES + header_size


def _is_size(value: object) -> bool:
    return type(value) is int and 0 <= value <= MAX_SIZE


def _span(path: Path, name: str, info: object) -> Span:
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise _corrupt(
            path, f"tensor {shown(name)} needs dtype, shape and data_offsets, got {shown(info)}"
        )
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(code, str) or code not in _DTYPES:
        raise _corrupt(
            path, f"tensor {shown(name)} has dtype {shown(code)}; expected one of {list(_DTYPES)}"
        )
    if not isinstance(shape, list) or len(shape) > 4 or not all(map(_is_size, shape)):
        raise _corrupt(
            path,
            f"tensor {shown(name)} has shape {shown(shape)}; expected a list of at most 4 "
            f"sizes, each an int from 0 to {MAX_SIZE}",
        )
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(offset) is int and offset >= 0 for offset in offsets)
        and offsets[0] <= offsets[1]
    ):
        raise _corrupt(
            path,
            f"tensor {shown(name)} has data_offsets {shown(offsets)}; expected [begin, end], "
            "two ints with 0 <= begin <= end",
        )
    dtype = _DTYPES[code]
    begin, end = offsets
    needed = math.prod(shape) * dtype.itemsize
    if end - begin != needed:
        raise _corrupt(
            path,
            f"tensor {shown(name)} has data_offsets [{begin}, {end}] ({end - begin} bytes), "
            f"but {code} of shape {tuple(shape)} takes {needed} bytes",
        )
    return Span(dtype, tuple(shape), begin, end)


def tensor_spans(path: Path, header: dict[str, Any], data_start: int, size: int) -> dict[str, Span]:
    """Every tensor's span, checked to tile the data section exactly.

    Raises `CacheFileError` for a malformed tensor entry, ranges that overlap or leave a
    gap, or a data section whose end is not the end of the file.
    """
    spans = {
        name: _span(path, name, info) for name, info in header.items() if name != "__metadata__"
    }
    position = 0
    for name, span in sorted(spans.items(), key=lambda item: (item[1].begin, item[1].end)):
        if span.begin != position:
            raise _corrupt(
                path,
                f"tensor {shown(name)} starts at byte {span.begin} of the data, where the "
                f"tensors before it end at {position} (tensors overlap or leave a gap)",
            )
        position = span.end
    if data_start + position != size:
        raise CacheFileError(
            f"{path} is truncated or corrupt: its header describes "
            f"{data_start + position} bytes, the file has {size}"
        )
    return spans


def read_tensor(
    path: Path, file: BufferedReader, data_start: int, name: str, span: Span
) -> torch.Tensor:
    """The tensor `name` at `span`, read into its own buffer of the checked size.

    Raises `CacheFileError` when the file is cut short while it is read.
    """
    raw = torch.empty(span.end - span.begin, dtype=torch.uint8)
    file.seek(data_start + span.begin)
    if file.readinto(bytes_of(raw)) != len(raw):
        raise CacheFileError(f"{path} is truncated: it was cut short while {name} was read")
    return raw.view(span.dtype).reshape(span.shape)

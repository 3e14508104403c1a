"""A sharded job's output folder: its fingerprint, its layout and each finished shard.

`job.json` records the job's fingerprint (one string per part: model, tokens, function,
metric, options) and its layout (the `[start, stop)` item range of every shard). Each
finished shard is one safetensors file, `shard-{start}-{stop}.safetensors`, written by
the driver as soon as the shard's result arrives: every tensor flattened, with its shape,
a CRC-32 of its bytes and the job's hash in the JSON metadata. Files are written to a
temporary name and renamed, so an interrupt leaves every shard whole or absent.

Opened again, the folder must hold the same job (else
[`JobFolderError`][safelens.JobFolderError], naming the parts that differ). Finished
shards are read back with the strict safetensors reader (no code runs; a header, shape
or size that does not fit, or bytes whose CRC-32 differs, are caught in time bounded by
the file's size); a shard that cannot be read is refused, never silently recomputed or
used: delete it and the job recomputes it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import zlib
from pathlib import Path
from typing import Any

import torch

from ..core._errors import CacheFileError, JobFolderError
from ..core._safetensors_file import (
    bytes_of,
    read_header,
    read_tensor,
    tensor_spans,
    write_safetensors,
)

__all__ = ["ShardFolder", "Layout"]

Layout = list[tuple[int, int]]
_JOB_FORMAT = "safelens.sharded_job"
_SHARD_FORMAT = "safelens.shard"
_VERSION = 1


def _checksum(tensor: torch.Tensor) -> str:
    return f"{zlib.crc32(bytes_of(tensor)):08x}"


class ShardFolder:
    """The output folder of one job: checked on opening, then written shard by shard."""

    def __init__(self, path: str | os.PathLike[str], fingerprint: dict[str, str]) -> None:
        self.path = Path(path)
        self.fingerprint = fingerprint
        text = json.dumps(fingerprint, sort_keys=True)
        self.job = hashlib.sha256(text.encode()).hexdigest()[:32]

    def open(self, layout: Layout, layout_given: bool) -> Layout:
        """Check (or create) the folder for this job; return the layout to run.

        A folder that already holds this job keeps its own layout, unless the caller
        chose one (`layout_given`) that differs. Raises `JobFolderError` for a folder of
        another job, an unreadable `job.json`, or a layout that differs.
        """
        record = self.path / "job.json"
        if self.path.exists() and not self.path.is_dir():
            raise JobFolderError(f"output_dir {self.path} is a file; pass a folder")
        if not record.exists():
            self.path.mkdir(parents=True, exist_ok=True)
            body = {"format": _JOB_FORMAT, "version": _VERSION}
            body |= {"fingerprint": self.fingerprint, "layout": layout}
            written = record.with_name(".job.json.tmp")
            written.write_text(json.dumps(body, indent=1))
            os.replace(written, record)
            return layout
        saved = self._record(record)
        differ = sorted(
            name
            for name in {*self.fingerprint, *saved["fingerprint"]}
            if self.fingerprint.get(name) != saved["fingerprint"].get(name)
        )
        if differ:
            shown = "; ".join(
                f"{name}: saved {saved['fingerprint'].get(name)!r}, now "
                f"{self.fingerprint.get(name)!r}"
                for name in differ
            )
            raise JobFolderError(
                f"output_dir {self.path} holds the shards of another job: its {', '.join(differ)} "
                f"differ ({shown}). Pass a new output_dir, or delete this one to start over"
            )
        stored = [tuple(span) for span in saved["layout"]]
        if layout_given and stored != layout:
            raise JobFolderError(
                f"output_dir {self.path} holds this job cut into {len(stored)} shards, but "
                f"shard_size now cuts it into {len(layout)}; pass shard_size=None to resume "
                "with the folder's shards"
            )
        return stored  # type: ignore[return-value]

    def _record(self, record: Path) -> dict[str, Any]:
        try:
            saved = json.loads(record.read_text())
            valid = (
                saved.get("format") == _JOB_FORMAT
                and saved.get("version") == _VERSION
                and isinstance(saved.get("fingerprint"), dict)
                and all(
                    isinstance(span, list) and len(span) == 2 and all(type(i) is int for i in span)
                    for span in saved.get("layout")
                )
            )
        except (ValueError, TypeError, AttributeError):
            valid = False
        if not valid:
            raise JobFolderError(
                f"{record} is not the record of a safelens sharded job (written by RayWorkers, "
                f"format {_JOB_FORMAT!r} version {_VERSION}); pass a new output_dir"
            )
        return saved

    def shard_path(self, span: tuple[int, int]) -> Path:
        return self.path / f"shard-{span[0]:09d}-{span[1]:09d}.safetensors"

    def write(self, span: tuple[int, int], tensors: dict[str, torch.Tensor]) -> None:
        """Write one finished shard (CPU tensors), atomically."""
        flat = {name: tensor.contiguous().reshape(-1) for name, tensor in tensors.items()}
        metadata = {
            "format": _SHARD_FORMAT,
            "version": str(_VERSION),
            "job": self.job,
            "span": json.dumps(list(span)),
            "shapes": json.dumps({name: list(t.shape) for name, t in tensors.items()}),
            "crc32": json.dumps({name: _checksum(t) for name, t in flat.items()}),
        }
        write_safetensors(self.shard_path(span), flat, metadata)

    def finished(self, layout: Layout) -> dict[int, dict[str, torch.Tensor]]:
        """Every shard of `layout` already in the folder, read and checked, by index."""
        return {
            index: self._read(span)
            for index, span in enumerate(layout)
            if self.shard_path(span).exists()
        }

    def _read(self, span: tuple[int, int]) -> dict[str, torch.Tensor]:
        path = self.shard_path(span)
        try:
            return self._read_checked(path, span)
        except CacheFileError as error:
            raise JobFolderError(
                f"shard file {path} cannot be used: {error}. Delete it and run the job again: "
                "the shard is then recomputed"
            ) from None

    def _read_checked(self, path: Path, span: tuple[int, int]) -> dict[str, torch.Tensor]:
        size = path.stat().st_size
        with path.open("rb") as file:
            header, start = read_header(path, file, size)
            spans = tensor_spans(path, header, start, size)
            shapes, sums = _shard_metadata(header.get("__metadata__"), span, set(spans), self.job)
            tensors = {}
            for name, where in spans.items():
                tensor = read_tensor(path, file, start, name, where)
                shape = shapes[name]
                sizes = isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)
                if not sizes or math.prod(shape) != tensor.numel() or len(where.shape) != 1:
                    raise CacheFileError(f"tensor {name!r} does not have the shape {shape}")
                if _checksum(tensor) != sums[name]:
                    raise CacheFileError(f"tensor {name!r} has bytes whose CRC-32 differs")
                tensors[name] = tensor.reshape(shape)
        return tensors


def _shard_metadata(
    meta: Any, span: tuple[int, int], names: set[str], job: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The shapes and CRC-32s a shard's metadata gives, or a `CacheFileError`."""
    try:
        if meta["format"] == _SHARD_FORMAT and meta["version"] == str(_VERSION):
            shapes, sums = json.loads(meta["shapes"]), json.loads(meta["crc32"])
            if set(shapes) == set(sums) == names and json.loads(meta["span"]) == list(span):
                if meta["job"] == job:
                    return shapes, sums
                raise CacheFileError(f"it belongs to job {meta['job']!r}, not {job!r}")
    except (KeyError, TypeError, json.JSONDecodeError):
        pass
    raise CacheFileError(
        "its metadata is not that of this safelens shard (format, version, span, shapes, crc32)"
    )

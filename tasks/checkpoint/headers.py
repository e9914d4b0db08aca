"""safetensors headers, from a local file or from the Hub by range requests, treated as hostile.

One parser serves both paths so a checkpoint gets the same verdict before and after download. A
header is bounded (length, offsets, dtypes) before it is trusted: a corrupt or malicious shard must
give a one-line error, never a crash or a multi-GB allocation. Only headers are read, plus the
2-value weight_shape tensors of local files; the bytes read are counted.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import orjson

from tasks.errors import CheckpointError

# safetensors' own reader refuses headers above 100 MB; Kimi-K2.5's largest is a few MB.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# All of a checkpoint's headers together, per run: Kimi-K2.5's 64 come to ~50 MB. Each file's
# length prefix is read first (8 bytes), and their sum is held to this before any header is read,
# so four shards that claim 100 MB each cost 32 bytes, not 4 GB of parsed JSON.
MAX_RUN_HEADER_BYTES = 256 * 1024 * 1024
MAX_INT_VALUES_BYTES = 64  # a weight_shape is 2 values; a "weight_shape" of a billion is not read
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}
_INT_FORMATS = {"I32": "i", "I64": "q", "U32": "I", "U64": "Q", "I16": "h", "U16": "H", "I8": "b", "U8": "B"}


class TensorMeta(NamedTuple):  # a tuple: 200k of them are built per Kimi-sized checkpoint
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int
    file: str

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class FileHeader:
    file: str
    file_size: int
    header_bytes: int  # 8-byte length prefix plus the JSON header
    tensors: dict[str, TensorMeta]


def header_length(file: str, file_size: int, read: Callable[[int, int], bytes]) -> int:
    """The header's length from its 8-byte prefix, refused beyond the file or the per-file limit."""
    if file_size < 8:
        raise CheckpointError(f"{file}: {file_size} bytes is too short for a safetensors file")
    (length,) = struct.unpack("<Q", read(0, 8))
    if length > MAX_HEADER_BYTES or 8 + length > file_size:
        raise CheckpointError(
            f"{file}: header claims {length} bytes but the file has {file_size} (limit {MAX_HEADER_BYTES})"
        )
    return length


def check_run_budget(lengths: dict[str, int], source: str, limit: int = MAX_RUN_HEADER_BYTES) -> None:
    """The headers a run is about to read, together, within `limit`: refused before any is read."""
    total = sum(lengths.values())
    if total > limit:
        largest = max(lengths, key=lengths.__getitem__)
        raise CheckpointError(f"{source}: the headers of its {len(lengths)} safetensors files claim {total:,} bytes "
                              f"in all, beyond the {limit:,} one validation reads (largest: {largest}, "
                              f"{lengths[largest]:,})")


def parse_header(file: str, file_size: int, read: Callable[[int, int], bytes], *, length: int | None = None
                 ) -> FileHeader:
    """Parse one header through read(offset, length), refusing anything out of bounds; `length`
    where the prefix was read already (and counted against the run's budget)."""
    if length is None:
        length = header_length(file, file_size, read)
    try:
        raw = orjson.loads(read(8, length))  # ships with prefect; ~2x json's speed on 30 MB of headers
    except orjson.JSONDecodeError as exc:
        raise CheckpointError(f"{file}: header is not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: header is not a JSON object")
    data_start, data_len = 8 + length, file_size - 8 - length
    tensors: dict[str, TensorMeta] = {}
    make, prod, widths = tuple.__new__, math.prod, DTYPE_BYTES
    for name, entry in raw.items():
        if name == "__metadata__":
            continue
        # The common case in one expression, no call per entry; anything it doubts goes to _tensor,
        # which accepts exactly the same entries and names the problem in the rest.
        try:
            dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            count = prod(shape)
            valid = (type(shape) is list and type(count) is int and type(start) is int and type(end) is int
                     and 0 <= start <= end <= data_len and end - start == count * widths[dtype]
                     and (not shape or min(shape) >= 0))
        except (TypeError, KeyError, ValueError):
            valid = False
        if valid:
            tensors[name] = make(TensorMeta, (dtype, tuple(shape), data_start + start, data_start + end, file))
        else:
            tensors[name] = _tensor(file, name, entry, data_start=data_start, data_len=data_len)
    spans = sorted((t.start, t.end, n) for n, t in tensors.items() if t.end > t.start)
    for (_, prev_end, prev), (start, _, name) in zip(spans, spans[1:]):
        if start < prev_end:
            raise CheckpointError(f"{file}: tensors {prev} and {name} overlap in the data section")
    return FileHeader(file=file, file_size=file_size, header_bytes=8 + length, tensors=tensors)


def _tensor(file: str, name: str, entry: object, *, data_start: int, data_len: int) -> TensorMeta:
    """One header entry, checked field by field so that a bad one is named."""
    where = f"{file}: tensor {name}"
    if type(entry) is not dict:
        raise CheckpointError(f"{where}: entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    width = DTYPE_BYTES.get(dtype) if type(dtype) is str else None
    if width is None:
        raise CheckpointError(f"{where}: unknown dtype {dtype!r}")
    # prod of a list is an int only when every element is one: floats, strings, lists fall out here.
    try:
        count = math.prod(shape) if type(shape) is list else None
    except TypeError:
        count = None
    if type(count) is not int or (shape and min(shape) < 0):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of sizes")
    if (type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int or type(offsets[1]) is not int
            or not 0 <= offsets[0] <= offsets[1] <= data_len):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} outside the {data_len}-byte data section")
    if offsets[1] - offsets[0] != count * width:
        raise CheckpointError(f"{where}: {offsets[1] - offsets[0]} bytes for {dtype}{shape}")
    return TensorMeta(dtype, tuple(shape), start=data_start + offsets[0], end=data_start + offsets[1], file=file)


def read_local_header(path: Path, length: int | None = None) -> FileHeader:
    size = path.stat().st_size
    with path.open("rb") as fh:
        def read(offset: int, length: int) -> bytes:
            fh.seek(offset)
            return fh.read(length)

        return parse_header(path.name, size, read, length=length)


def local_header_length(path: Path) -> int:
    with path.open("rb") as fh:
        return header_length(path.name, path.stat().st_size, lambda offset, n: fh.read(n))


def read_int_values(path: Path, metas: list[TensorMeta]) -> dict[TensorMeta, tuple[int, ...]]:
    """The values of small integer tensors (weight_shape), in one pass over the file in offset order."""
    values = {}
    fd = os.open(path, os.O_RDONLY)
    try:
        for meta in sorted(metas, key=lambda m: m.start):
            if meta.nbytes > MAX_INT_VALUES_BYTES:
                continue  # not the 2-value tensor the rules compare; its layout check names it
            if (layout := _int_struct(meta.dtype, meta.shape)) is not None:
                values[meta] = layout.unpack(os.pread(fd, meta.nbytes, meta.start))
    finally:
        os.close(fd)
    return values


@functools.lru_cache(maxsize=64)
def _int_struct(dtype: str, shape: tuple[int, ...]) -> struct.Struct | None:
    fmt = _INT_FORMATS.get(dtype)
    return None if fmt is None else struct.Struct(f"<{math.prod(shape)}{fmt}")


def read_remote_header(url: str, file: str, file_size: int, *, headers: dict[str, str], length: int | None = None
                       ) -> FileHeader:
    """Two range requests: the 8-byte length (unless `length` was read already), then exactly the header."""
    return parse_header(file, file_size, _remote_reader(url, file, headers), length=length)


def remote_header_length(url: str, file: str, file_size: int, *, headers: dict[str, str]) -> int:
    return header_length(file, file_size, _remote_reader(url, file, headers))


def _remote_reader(url: str, file: str, headers: dict[str, str]) -> Callable[[int, int], bytes]:
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session, hf_raise_for_status

    session = get_session()

    def read(offset: int, length: int) -> bytes:
        # Streamed, so a server that ignores Range (200, whole file) costs only the bytes kept.
        with session.stream("GET", url, headers={**headers, "Range": f"bytes={offset}-{offset + length - 1}"},
                            follow_redirects=True, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as r:
            hf_raise_for_status(r)
            skip = offset if r.status_code == 200 else 0
            body = bytearray()
            for chunk in r.iter_bytes():
                body += chunk
                if len(body) >= skip + length:
                    break
        body = bytes(body[skip: skip + length])
        if len(body) != length:
            raise CheckpointError(f"{file}: asked the hub for {length} bytes at {offset}, got {len(body)}")
        return body

    return read

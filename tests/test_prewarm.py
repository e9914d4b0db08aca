"""The new model's shards read into the page cache before the swap, within the memory budget."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import pytest

from tasks.prewarm import prewarm

pytestmark = pytest.mark.quiet  # measures speed: runs alone, before the parallel part (Makefile)

MIB = 2**20
_libc = ctypes.CDLL(None, use_errno=True)


def resident_share(path: Path) -> float:
    """The share of the file's pages in the page cache: mincore(2) over a private mapping (writable,
    so ctypes can take its address; never written, so no page is copied or read by this)."""
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vector = (ctypes.c_ubyte * pages)()
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), size, flags=mmap.MAP_PRIVATE,
                                          prot=mmap.PROT_READ | mmap.PROT_WRITE) as mapped:
        start = ctypes.c_char.from_buffer(mapped)
        failed = _libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), vector)
        del start  # the mapping cannot close while ctypes holds a pointer into it
    if failed:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vector) / pages


def _cold(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _model(folder: Path, shards: int, mib: int) -> list[Path]:
    folder.mkdir()
    paths = []
    for i in range(shards):
        path = folder / f"model-{i:05d}.safetensors"
        path.write_bytes(os.urandom(mib * MIB))
        _cold(path)
        paths.append(path)
    (folder / "config.json").write_text("{}")
    return paths


def test_shards_are_read_into_the_page_cache(tmp_path):
    shards = _model(tmp_path / "new", 3, 8)
    assert all(resident_share(p) < 0.5 for p in shards)
    done = prewarm(tmp_path / "new", margin_bytes=0, available_bytes=1 << 40)
    assert done.read_bytes == done.total_bytes == 24 * MIB and done.left_out == ""
    assert all(resident_share(p) > 0.95 for p in shards)


def test_what_the_memory_does_not_hold_is_left_cold_and_said(tmp_path):
    shards = _model(tmp_path / "new", 3, 8)
    _model(tmp_path / "serving", 1, 8)
    # 40 MiB available, 16 MiB margin, the serving model's 8 MiB kept: one 8 MiB shard fits, not two.
    done = prewarm(tmp_path / "new", keep_warm=tmp_path / "serving", margin_bytes=16 * MIB,
                   available_bytes=40 * MIB)
    assert done.read_bytes == 16 * MIB  # 40 - 16 - 8 = 16 MiB: two whole shards
    assert done.left_out.startswith("1 of 3 shards (0.01 GB) left cold: MemAvailable 0.0 GB less the margin")
    assert "and the serving model's 0.0 GB does not hold them" in done.left_out
    assert resident_share(shards[2]) < 0.5

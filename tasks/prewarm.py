"""Read the new model's shards into the page cache while the old server still serves.

From the old server's stop to the new one's first answer the host serves nothing, and on a cold
page cache most of that is vLLM reading the checkpoint from disk (DeepSeek-V3 on 8x B200: 1,500 s
with vLLM's default reading, vllm PR #36012). The shards are verified and on disk minutes before the
swap, so they can be read then, while the old model answers: vLLM's load after the stop is then
served from memory. The reading stays within MemAvailable less a margin and less the serving
model's own files (their pages make a rollback's restart fast: they are not given up for this),
and says how much it read and what it left out.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

CHUNK = 16 * 2**20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


@dataclass(frozen=True)
class Prewarm:
    read_bytes: int
    total_bytes: int
    seconds: float
    left_out: str = ""  # why some shards were not read (memory), empty when all were

    def text(self) -> str:
        done = f"read {self.read_bytes / 1e9:.2f} of {self.total_bytes / 1e9:.2f} GB into the page cache " \
               f"in {self.seconds:.1f} s"
        return done + (f"; {self.left_out}" if self.left_out else "")


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{meminfo} has no MemAvailable line")


def weight_files(model_dir: Path) -> list[Path]:
    return sorted(p for p in model_dir.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))


def _size(files: list[Path]) -> int:
    return sum(p.stat().st_size for p in files)


def prewarm(model_dir: Path, *, keep_warm: Path | None = None, margin_bytes: int = 4 * 2**30,
            available_bytes: int | None = None) -> Prewarm:
    """Read `model_dir`'s weight files, whole shards in order, while they fit the memory budget:
    MemAvailable less `margin_bytes` less the files of `keep_warm` (the serving model)."""
    files = weight_files(model_dir)
    total = _size(files)
    available = mem_available_bytes() if available_bytes is None else available_bytes
    kept = _size(weight_files(keep_warm)) if keep_warm is not None and keep_warm.is_dir() else 0
    budget = available - margin_bytes - kept
    started, read, skipped = time.perf_counter(), 0, []
    for path in files:
        size = path.stat().st_size
        if read + size > budget:
            skipped.append(path)
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while os.read(fd, CHUNK):
                pass
        finally:
            os.close(fd)
        read += size
    left_out = ""
    if skipped:
        left_out = (f"{len(skipped)} of {len(files)} shards ({_size(skipped) / 1e9:.2f} GB) left cold: "
                    f"MemAvailable {available / 1e9:.1f} GB less the margin {margin_bytes / 1e9:.1f} GB"
                    + (f" and the serving model's {kept / 1e9:.1f} GB" if kept else "") + " does not hold them")
    return Prewarm(read_bytes=read, total_bytes=total, seconds=time.perf_counter() - started, left_out=left_out)

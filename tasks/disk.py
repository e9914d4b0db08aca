"""Free space on the models filesystem, measured by the OS.

Arithmetic on model sizes lied by ~185 GB in the deployment this replaces (snapshots, reservations,
GB vs GiB), so every decision here comes from statvfs of the filesystem that will hold the files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from prefect import task

GB = 10**9


class DiskSpaceError(RuntimeError):
    """The model will not fit on the models filesystem."""


@dataclass(frozen=True)
class DiskSpace:
    path: Path
    total_bytes: int
    free_bytes: int


def _existing_ancestor(path: Path) -> Path:
    """statvfs needs an existing path; the models root may not have been created yet."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def measure(path: Path) -> DiskSpace:
    """Space an unprivileged writer can actually use (f_bavail, not f_bfree)."""
    probe = _existing_ancestor(path)
    st = os.statvfs(probe)
    return DiskSpace(path=probe, total_bytes=st.f_blocks * st.f_frsize, free_bytes=st.f_bavail * st.f_frsize)


def ensure_fits(path: Path, needed_bytes: int, margin_bytes: int = 0) -> DiskSpace:
    """Refuse before the first byte is written when the download cannot complete."""
    space = measure(path)
    if needed_bytes + margin_bytes > space.free_bytes:
        raise DiskSpaceError(
            f"model needs {needed_bytes / GB:.2f} GB (+{margin_bytes / GB:.2f} GB margin) but "
            f"{space.path} has {space.free_bytes / GB:.2f} GB free"
        )
    return space


@task(name="check-disk", tags=["disk"])
def check_disk(path: Path, needed_bytes: int, margin_bytes: int = 0) -> DiskSpace:
    return ensure_fits(path, needed_bytes, margin_bytes)

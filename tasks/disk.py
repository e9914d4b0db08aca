"""Free space on the models filesystem, and a plan for making room that keeps a way back.

Arithmetic on model sizes lied by ~185 GB in the deployment this replaces (snapshots, reservations,
GB vs GiB), so every decision here starts from statvfs of the filesystem that will hold the files,
and every deletion is checked against statvfs again. The old variant was deleted there before the
new one was known to load; here the model being served and pinned models are never candidates, and
the last known good model (the fallback) goes only when nothing else frees enough, loudly.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from huggingface_hub import scan_cache_dir
from pydantic import BaseModel

from tasks.errors import DiskSpaceError, UnusableInput

GB = 10**9
MODEL_DIRS_SKIPPED = {"hub", ".rollout", "lost+found"}  # models_root/hub is the HF cache, scanned per revision


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


def check_models_root(models_root: Path) -> None:
    """The models root may be created, but its parent must exist: a typo (/modles/kimi) would put the
    download on whatever filesystem holds the first folder that does exist, often the root disk."""
    parent = models_root.absolute().parent
    if not models_root.exists() and not parent.is_dir():
        raise UnusableInput(f"models_root {models_root}: its parent {parent} does not exist (a typo?); "
                            "create the folder first if it is meant")


def measure(path: Path) -> DiskSpace:
    """Space an unprivileged writer can actually use (f_bavail, not f_bfree)."""
    probe = _existing_ancestor(path)
    st = os.statvfs(probe)
    return DiskSpace(path=probe, total_bytes=st.f_blocks * st.f_frsize, free_bytes=st.f_bavail * st.f_frsize)


class StoredModel(BaseModel):
    """One deletable unit: a cached revision of a Hub repo, or a plain model folder."""

    name: str  # "org/name@commit12" or the folder's path
    kind: Literal["hf-revision", "folder"]
    path: Path  # the snapshot folder vLLM would be pointed at, or the folder itself
    repo_id: str | None = None
    commit: str | None = None
    bytes: int  # allocated blocks that deleting it alone gives back (blobs no other revision uses)
    last_used: float  # newest access or modification time of its files

    def matches(self, ref: str) -> bool:
        """A pin names a repo (all its revisions), a repo@commit prefix, or a folder path."""
        if self.repo_id and (ref == self.repo_id or (ref.startswith(self.repo_id + "@")
                                                      and (self.commit or "").startswith(ref.split("@", 1)[1]))):
            return True
        return self.kind == "folder" and Path(ref).absolute() == self.path.absolute()

    def holds(self, path: Path) -> bool:
        path = path.absolute()
        return path == self.path.absolute() or self.path.absolute() in path.parents


class PlanEntry(BaseModel):
    model: StoredModel
    action: Literal["keep", "evict"]
    reason: str


class DiskPlan(BaseModel):
    filesystem: Path
    total_bytes: int
    free_bytes: int
    needed_bytes: int  # what the new model still has to download
    margin_bytes: int
    entries: list[PlanEntry]
    fits: bool
    warnings: list[str]

    @property
    def evictions(self) -> list[PlanEntry]:
        return [e for e in self.entries if e.action == "evict"]

    @property
    def freed_bytes(self) -> int:
        return sum(e.model.bytes for e in self.evictions)

    @property
    def shortfall_bytes(self) -> int:
        return max(0, self.needed_bytes + self.margin_bytes - self.free_bytes)


def _allocated(path: Path) -> int:
    """Blocks, not st_size: sparse and partly written files free only what they occupy."""
    st = path.stat()
    return st.st_blocks * 512


def _times(path: Path) -> float:
    st = path.stat()
    return max(st.st_atime, st.st_mtime)


def inventory(models_root: Path) -> list[StoredModel]:
    """Every model on the filesystem: the HF cache per revision (huggingface_hub's scan) and folders."""
    models: list[StoredModel] = []
    cache_dir = models_root / "hub"
    if cache_dir.is_dir():
        for repo in scan_cache_dir(cache_dir).repos:
            users: dict[Path, int] = {}
            for rev in repo.revisions:
                for f in rev.files:
                    users[f.blob_path] = users.get(f.blob_path, 0) + 1
            for rev in repo.revisions:
                blobs = {f.blob_path for f in rev.files}
                models.append(StoredModel(
                    name=f"{repo.repo_id}@{rev.commit_hash[:12]}", kind="hf-revision", path=rev.snapshot_path,
                    repo_id=repo.repo_id, commit=rev.commit_hash,
                    bytes=sum(_allocated(b) for b in blobs if users[b] == 1),
                    last_used=max([rev.last_modified] + [_times(b) for b in blobs]),
                ))
    if models_root.is_dir():
        for folder in sorted(p for p in models_root.iterdir() if p.is_dir() and not p.is_symlink()
                             and p.name not in MODEL_DIRS_SKIPPED):
            files = [Path(d) / n for d, _, names in os.walk(folder) for n in names]
            files = [f for f in files if not f.is_symlink()]
            models.append(StoredModel(
                name=str(folder), kind="folder", path=folder,
                bytes=sum(_allocated(f) for f in files),
                last_used=max([_times(folder)] + [_times(f) for f in files]),
            ))
    return models


def plan_space(models_root: Path, needed_bytes: int, margin_bytes: int, *, target: tuple[str, str],
               served: Path | None = None, pinned: list[str] = (), fallback: Path | None = None) -> DiskPlan:
    """What to delete so the new model (`target` = repo_id, commit) fits, least recently used first.

    The served model, pinned models and the target itself are kept whatever it costs. The fallback
    is the last resort: listed for eviction only when everything else together is not enough.
    """
    check_models_root(models_root)
    space = measure(models_root)
    shortfall = max(0, needed_bytes + margin_bytes - space.free_bytes)
    entries: list[PlanEntry] = []
    candidates: list[StoredModel] = []
    fallback_model: StoredModel | None = None
    for model in sorted(inventory(models_root), key=lambda m: m.last_used):
        if (model.repo_id, model.commit) == target:
            entries.append(PlanEntry(model=model, action="keep", reason="the model being deployed"))
        elif served is not None and model.holds(served):
            entries.append(PlanEntry(model=model, action="keep", reason="being served now"))
        elif any(model.matches(p) for p in pinned):
            entries.append(PlanEntry(model=model, action="keep", reason="pinned"))
        elif fallback is not None and model.holds(fallback):
            fallback_model = model
        else:
            candidates.append(model)
    freed = 0
    for model in candidates:
        if freed < shortfall:
            freed += model.bytes
            entries.append(PlanEntry(model=model, action="evict", reason="least recently used"))
        else:
            entries.append(PlanEntry(model=model, action="keep", reason="not needed to make room"))
    warnings = []
    if fallback_model is not None:
        if freed < shortfall:
            freed += fallback_model.bytes
            entries.append(PlanEntry(model=fallback_model, action="evict", reason="fallback, the last resort"))
            warnings.append(f"NO FALLBACK: the last known good model {fallback_model.name} must be deleted "
                            "before the download; if the new model fails there is nothing to roll back to")
        else:
            entries.append(PlanEntry(model=fallback_model, action="keep", reason="fallback (last known good)"))
    fits = freed >= shortfall
    if not fits:
        warnings.append(f"deleting every candidate frees {freed / GB:.2f} GB of the {shortfall / GB:.2f} GB missing")
    return DiskPlan(filesystem=space.path, total_bytes=space.total_bytes, free_bytes=space.free_bytes,
                    needed_bytes=needed_bytes, margin_bytes=margin_bytes, entries=entries, fits=fits,
                    warnings=warnings)


def plan_summary(plan: DiskPlan) -> str:
    return (f"needs {plan.needed_bytes / GB:.2f} GB + {plan.margin_bytes / GB:.2f} GB margin, "
            f"{plan.free_bytes / GB:.2f} GB free on {plan.filesystem}")


def check_plan(plan: DiskPlan, dry_run: bool) -> None:
    """Refuse before anything is deleted or downloaded when the plan cannot make the model fit."""
    if not plan.fits:
        raise DiskSpaceError(f"model will not fit: {plan_summary(plan)}; {plan.warnings[-1]}")
    if dry_run and plan.evictions:
        names = ", ".join(e.model.name for e in plan.evictions)
        raise DiskSpaceError(f"dry run: {plan_summary(plan)}; the plan deletes {names} "
                             f"({plan.freed_bytes / GB:.2f} GB): set evict=true to delete them")


@dataclass(frozen=True)
class EvictionResult:
    deleted: list[str]
    expected_freed_bytes: int
    free_before_bytes: int
    free_after_bytes: int

    @property
    def measured_freed_bytes(self) -> int:
        return self.free_after_bytes - self.free_before_bytes


def evict(plan: DiskPlan, models_root: Path, tolerance_bytes: int = 64 * 2**20) -> EvictionResult:
    """Delete what the plan lists, then ask the filesystem whether it gave the space back.

    Snapshots, hard links and open files keep blocks allocated after a delete; the download must
    not start on arithmetic, so a shortfall beyond `tolerance_bytes` (other writers) is an error.
    """
    before = measure(models_root).free_bytes
    revisions = [e.model.commit for e in plan.evictions if e.model.kind == "hf-revision"]
    if revisions:
        scan_cache_dir(models_root / "hub").delete_revisions(*revisions).execute()
    for entry in plan.evictions:
        if entry.model.kind == "folder":
            shutil.rmtree(entry.model.path)
    result = EvictionResult([e.model.name for e in plan.evictions], plan.freed_bytes, before,
                            measure(models_root).free_bytes)
    if result.measured_freed_bytes < result.expected_freed_bytes - tolerance_bytes:
        raise DiskSpaceError(
            f"deleted {', '.join(result.deleted)}: the plan expected {result.expected_freed_bytes / GB:.2f} GB back, "
            f"the filesystem gave {result.measured_freed_bytes / GB:.2f} GB (free {before / GB:.2f} -> "
            f"{result.free_after_bytes / GB:.2f} GB); snapshots or other links may hold the blocks")
    if result.free_after_bytes < plan.needed_bytes + plan.margin_bytes:
        raise DiskSpaceError(f"after deleting, {result.free_after_bytes / GB:.2f} GB free on {plan.filesystem}, "
                             f"the model needs {(plan.needed_bytes + plan.margin_bytes) / GB:.2f} GB")
    return result

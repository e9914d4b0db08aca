"""The disk plan on a real filesystem: an HF cache and model folders of real, allocated bytes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.disk import check_plan, evict, inventory, measure, plan_space
from tasks.errors import DiskSpaceError
from tasks.vllm.process import served_model

MB = 10**6


def cached_revision(root: Path, repo_id: str, commit: str, size: int, used: float) -> Path:
    """One revision in the HF cache layout: a blob of `size` written bytes and its snapshot link."""
    repo = root / "hub" / f"models--{repo_id.replace('/', '--')}"
    blob = repo / "blobs" / f"{commit}-blob"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(os.urandom(size))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to(os.path.relpath(blob, snap))
    os.utime(blob, (used, used))
    os.utime(snap, (used, used))
    return snap


def folder_model(root: Path, name: str, size: int, used: float) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(os.urandom(size))
    os.utime(folder / "model.safetensors", (used, used))
    os.utime(folder, (used, used))
    return folder


@pytest.fixture
def models_root(tmp_path) -> Path:
    root = tmp_path / "models"
    now = time.time()
    cached_revision(root, "org/oldest", "a" * 40, 20 * MB, now - 5000)
    cached_revision(root, "org/served", "b" * 40, 20 * MB, now - 4000)
    cached_revision(root, "org/pinned", "c" * 40, 20 * MB, now - 3000)
    cached_revision(root, "org/fallback", "d" * 40, 20 * MB, now - 2000)
    folder_model(root, "hand-copied-nvfp4", 20 * MB, now - 1000)
    cached_revision(root, "org/newest", "e" * 40, 20 * MB, now - 10)
    return root


def _needing(root: Path, extra: int) -> int:
    """A model that needs `extra` bytes more than the filesystem has free right now."""
    return measure(root).free_bytes + extra


def test_inventory_lists_revisions_and_folders_with_allocated_sizes(models_root):
    found = {m.name: m for m in inventory(models_root)}
    assert set(found) == {"org/oldest@aaaaaaaaaaaa", "org/served@bbbbbbbbbbbb", "org/pinned@cccccccccccc",
                          "org/fallback@dddddddddddd", "org/newest@eeeeeeeeeeee",
                          str(models_root / "hand-copied-nvfp4")}
    assert all(abs(m.bytes - 20 * MB) < 1 * MB for m in found.values())


def test_plan_evicts_least_recently_used_and_never_served_pinned_or_target(models_root):
    served = models_root / "hub" / "models--org--served" / "snapshots" / ("b" * 40)
    fallback = models_root / "hub" / "models--org--fallback" / "snapshots" / ("d" * 40)
    # 45 MB short: the three oldest unprotected models (20 MB each) are needed
    plan = plan_space(models_root, _needing(models_root, 45 * MB), 0, target=("org/newest", "e" * 40), served=served,
                      pinned=["org/pinned"], fallback=fallback)
    evicted = [e.model.name for e in plan.evictions]
    assert evicted[:2] == ["org/oldest@aaaaaaaaaaaa", str(models_root / "hand-copied-nvfp4")]
    kept = {e.model.name: e.reason for e in plan.entries if e.action == "keep"}
    assert kept["org/served@bbbbbbbbbbbb"] == "being served now"
    assert kept["org/pinned@cccccccccccc"] == "pinned"
    assert kept["org/newest@eeeeeeeeeeee"] == "the model being deployed"
    # only the fallback is left to free the third 20 MB: it goes, and the plan says so loudly
    assert evicted[2] == "org/fallback@dddddddddddd"
    assert plan.fits and any("NO FALLBACK" in w for w in plan.warnings)


def test_fallback_is_kept_when_other_models_free_enough(models_root):
    fallback = models_root / "hub" / "models--org--fallback" / "snapshots" / ("d" * 40)
    plan = plan_space(models_root, _needing(models_root, 5 * MB), 0, target=("org/newest", "e" * 40), fallback=fallback)
    assert [e.model.name for e in plan.evictions] == ["org/oldest@aaaaaaaaaaaa"]
    assert not plan.warnings
    assert plan.fits


def test_plan_that_cannot_fit_deletes_nothing(models_root):
    plan = plan_space(models_root, _needing(models_root, 10**12), 0, target=("org/newest", "e" * 40))
    assert not plan.fits
    with pytest.raises(DiskSpaceError, match="will not fit: needs"):
        check_plan(plan, dry_run=False)
    assert len(inventory(models_root)) == 6


def test_dry_run_names_what_it_would_delete_and_deletes_nothing(models_root):
    plan = plan_space(models_root, _needing(models_root, 5 * MB), 0, target=("org/newest", "e" * 40))
    with pytest.raises(DiskSpaceError, match=r"dry run: .*org/oldest@aaaaaaaaaaaa.*evict=true"):
        check_plan(plan, dry_run=True)
    assert len(inventory(models_root)) == 6


def test_evict_deletes_and_reports_measured_free_space(models_root):
    plan = plan_space(models_root, _needing(models_root, 25 * MB), 0, target=("org/newest", "e" * 40))
    check_plan(plan, dry_run=False)
    result = evict(plan, models_root, tolerance_bytes=8 * 2**20)
    assert result.deleted == ["org/oldest@aaaaaaaaaaaa", "org/served@bbbbbbbbbbbb"]
    assert result.measured_freed_bytes >= 40 * MB - 8 * 2**20
    assert {m.name for m in inventory(models_root)} == {
        "org/pinned@cccccccccccc", "org/fallback@dddddddddddd", "org/newest@eeeeeeeeeeee",
        str(models_root / "hand-copied-nvfp4")}


def test_evict_fails_when_the_filesystem_keeps_the_blocks(models_root, tmp_path):
    """A snapshot or a hard link elsewhere keeps the blocks: the arithmetic would lie, statvfs does not."""
    keeper = tmp_path / "snapshot-of-the-pool"
    keeper.mkdir()
    for blob in (models_root / "hub").glob("models--org--oldest/blobs/*"):
        os.link(blob, keeper / blob.name)
    plan = plan_space(models_root, _needing(models_root, 5 * MB), 0, target=("org/newest", "e" * 40))
    with pytest.raises(DiskSpaceError, match=r"expected 0\.02 GB back, the filesystem gave 0\.0\d GB \(free"):
        evict(plan, models_root, tolerance_bytes=8 * 2**20)


def test_served_model_comes_from_a_live_server_state_file(tmp_path):
    model = tmp_path / "models" / "served-model"
    model.mkdir(parents=True)
    command = [sys.executable, "-c", "import time; time.sleep(60)", "vllm", "--model", str(model)]
    proc = subprocess.Popen(command, start_new_session=True)
    state = tmp_path / "server.json"
    try:
        state.write_text(__import__("json").dumps({"pid": proc.pid, "pgid": proc.pid, "command": command}))
        assert served_model(state) == model
    finally:
        proc.kill()
        proc.wait()
    assert served_model(state) is None  # a dead server serves nothing

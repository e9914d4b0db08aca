"""The host's record of its last known good deployment: the fallback the disk plan keeps, the server
a failed deploy restores, and the benchmark the next deploy of the same model must not fall behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel

from tasks.history.runs import RunRecord
from tasks.trust import read_state_text
from tasks.vllm.process import serving_group
from tasks.vllm.settings import ServerConfig


class LastGood(BaseModel):
    repo_id: str
    commit: str
    model_dir: Path
    revision: str | None = None
    server: ServerConfig | None = None  # with the port it really listened on, so a restore takes the same address
    api_key_secret: str | None = None  # the Secret block's name; the key itself is never written here
    serving_pgid: int | None = None  # the vLLM group serving it now; None after a benchmark-only run
    record: RunRecord | None = None
    # The secondary nodes, {"host", "config"} (their DeployConfig as JSON: the form sits above the
    # history), which a restore of a multi-node deployment joins again before it starts the leader.
    group: list[dict[str, Any]] = []

    @property
    def what(self) -> str:
        """The deployment as logs, artifacts and errors name it: repo@commit (12 hex digits)."""
        return f"{self.repo_id}@{self.commit[:12]}"


def last_good_file(run_dir: Path) -> Path:
    return run_dir / "last-good.json"


def previous_good_file(run_dir: Path) -> Path:
    """The good deployment before the last good one: what `rollout rollback` returns to while the
    last good one serves."""
    return run_dir / "previous-good.json"


def _read(path: Path) -> LastGood | None:
    try:
        return LastGood.model_validate_json(read_state_text(path))
    except (FileNotFoundError, ValueError):  # ValidationError, too large, not UTF-8
        return None


def read_last_good(run_dir: Path) -> LastGood | None:
    """None when there is no record or it cannot be read: a broken record must not block a deploy."""
    return _read(last_good_file(run_dir))


def read_previous_good(run_dir: Path) -> LastGood | None:
    return _read(previous_good_file(run_dir))


def _write(path: Path, record: LastGood) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(record.model_dump_json(indent=2))
    tmp.replace(path)


def write_last_good(run_dir: Path, record: LastGood) -> None:
    _write(last_good_file(run_dir), record)


def promote_last_good(run_dir: Path, record: LastGood) -> None:
    """A deploy passed its checks: it becomes the last good one, and the one it replaces (another
    commit or launch) the previous good one, which a rollback by hand returns to."""
    before = read_last_good(run_dir)
    if before is not None and before.server is not None and (before.commit, before.server) != (
            record.commit, record.server):
        _write(previous_good_file(run_dir), before.model_copy(update={"serving_pgid": None}))
    write_last_good(run_dir, record)


def swap_to_previous(run_dir: Path) -> None:
    """After a rollback by hand to the previous good deployment: it is the last good one again, and
    the one rolled back from the previous (a second rollback returns to it, as `kubectl rollout undo`)."""
    last, previous = read_last_good(run_dir), read_previous_good(run_dir)
    if last is None or previous is None:
        return
    _write(previous_good_file(run_dir), last.model_copy(update={"serving_pgid": None}))
    write_last_good(run_dir, previous)


def serving_deployment(run_dir: Path) -> LastGood | None:
    """The host's last good deployment when its server is the one running now: it keeps serving
    while a new model downloads, and a failed swap restores it. None when nothing of it runs."""
    last = read_last_good(run_dir)
    current = serving_group(run_dir / "server.json")
    if last is None or last.server is None or current is None or last.serving_pgid != current:
        return None
    return last

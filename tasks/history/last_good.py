"""The host's record of its last known good deployment: the fallback the disk plan keeps, the server
a failed deploy restores, and the benchmark the next deploy of the same model must not fall behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from tasks.history.runs import RunRecord
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


def last_good_file(run_dir: Path) -> Path:
    return run_dir / "last-good.json"


def read_last_good(run_dir: Path) -> LastGood | None:
    """None when there is no record or it cannot be read: a broken record must not block a deploy."""
    try:
        return LastGood.model_validate_json(last_good_file(run_dir).read_text())
    except (FileNotFoundError, ValidationError):
        return None


def write_last_good(run_dir: Path, record: LastGood) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = last_good_file(run_dir).with_suffix(".tmp")
    tmp.write_text(record.model_dump_json(indent=2))
    tmp.replace(last_good_file(run_dir))


def serving_deployment(run_dir: Path) -> LastGood | None:
    """The host's last good deployment when its server is the one running now: it keeps serving
    while a new model downloads, and a failed swap restores it. None when nothing of it runs."""
    last = read_last_good(run_dir)
    current = serving_group(run_dir / "server.json")
    if last is None or last.server is None or current is None or last.serving_pgid != current:
        return None
    return last

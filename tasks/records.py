"""The host's record of its last known good deployment: the fallback the disk plan keeps."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ValidationError


class LastGood(BaseModel):
    repo_id: str
    commit: str
    model_dir: Path


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

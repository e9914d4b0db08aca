"""Settings a tune run promoted for a model on this host, beside last-good.json: the next deploy of
that model, the nightly's included, serves with them."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from pydantic import BaseModel, ValidationError

from tasks.trust import read_state_text
from tasks.vllm.settings import VllmSettings


class TunedSettings(BaseModel):
    repo_id: str
    settings: VllmSettings
    candidate: str  # the winner's name: its layout and what differs from the base
    time: datetime
    flow_run_id: str | None = None


def tuned_file(run_dir: Path) -> Path:
    return run_dir / "tuned.json"


def read_tuned(run_dir: Path, repo_id: str) -> TunedSettings | None:
    """None without a promotion for this model (or an unreadable file: it must not block a deploy)."""
    try:
        every = json.loads(read_state_text(tuned_file(run_dir)))
        found = every.get(repo_id) if isinstance(every, dict) else None
        return TunedSettings.model_validate(found) if found is not None else None
    except (FileNotFoundError, ValueError, ValidationError):  # absent, too large, not JSON, not a record
        return None


def write_tuned(run_dir: Path, tuned: TunedSettings) -> None:
    path = tuned_file(run_dir)
    try:
        every = json.loads(read_state_text(path))
    except (FileNotFoundError, ValueError):
        every = {}
    if not isinstance(every, dict):  # a damaged record is replaced by this promotion
        every = {}
    every[tuned.repo_id] = tuned.model_dump(mode="json")
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(every, indent=2))
    tmp.replace(path)

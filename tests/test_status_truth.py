"""`rollout status` after a power cut tells the truth (issue 40, item 3): an unfinished swap first,
with the command that finishes it; a dead server that is the last good deployment called that; and
`rollback to:` naming what `rollout rollback` would start. The host's records are written as a power
cut mid-swap leaves them (the deploy, its guard and every vLLM gone at once); no vLLM runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from flows.cli import app
from tasks.history.last_good import LastGood
from tasks.vllm.process import process_start_time
from tasks.vllm.settings import ServerConfig

runner = CliRunner()


def _group(alive: bool) -> int:
    """A process group whose command line names vLLM, as a server's does: alive, or gone."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "vllm"], start_new_session=True)
    if not alive:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return proc.pid


def _record(run_dir: Path, name: str, repo: str, commit: str, pgid: int | None) -> LastGood:
    good = LastGood(repo_id=repo, commit=commit, model_dir=run_dir.parent / commit,
                    server=ServerConfig(model_path=run_dir.parent / commit, served_model_name=repo, port=8000),
                    serving_pgid=pgid)
    (run_dir / name).write_text(good.model_dump_json())
    return good


def _server(run_dir: Path, pgid: int, model_dir: Path) -> None:
    (run_dir / "server.json").write_text(json.dumps({
        "pid": pgid, "pgid": pgid, "base_url": "http://127.0.0.1:9", "log_path": str(run_dir / "vllm.log"),
        "command": ["python", "-m", "vllm", "--model", str(model_dir), "--served-model-name", "org/m"]}))


def test_after_a_power_cut_status_says_the_swap_died_and_names_what_rollback_would_start(tmp_path):
    run_dir = tmp_path / "models" / ".rollout"
    run_dir.mkdir(parents=True)
    dead = _group(alive=False)
    _record(run_dir, "previous-good.json", "org/m", "a" * 40, None)
    good = _record(run_dir, "last-good.json", "org/m", "b" * 40, dead)
    _server(run_dir, dead, good.model_dir)
    gone = _group(alive=False)  # the deploy that owned the swap, dead with the rest
    (run_dir / "swap.json").write_text(json.dumps({
        "deploy_pid": gone, "deploy_started": process_start_time(os.getpid()), "what": "org/m@cccccccccccc",
        "models_root": str(tmp_path / "models"), "since": time.time(), "flow_run_id": None}))

    result = runner.invoke(app, ["status", "--models-root", str(tmp_path / "models")])
    lines = result.stdout.splitlines()
    assert result.exit_code == 1
    assert lines[0] == (f"UNFINISHED SWAP: the deploy of org/m@cccccccccccc (pid {gone}) died mid-swap; its guard "
                        f"brings the last good deployment back, or run `rollout recover --models-root "
                        f"{tmp_path / 'models'}`")
    assert lines[1].startswith(f"DEAD: the recorded vLLM (process group {dead}) is not running")
    assert f"  model:    org/m@{'b' * 12} (the last good deployment)" in lines
    assert f"  rollback to: org/m@{'b' * 12} (`rollout rollback`)" in lines  # the last good one: it serves not

    (run_dir / "swap.json").unlink()
    alive = _group(alive=True)
    try:
        _record(run_dir, "last-good.json", "org/m", "b" * 40, alive)
        _server(run_dir, alive, good.model_dir)
        result = runner.invoke(app, ["status", "--models-root", str(tmp_path / "models")])
        lines = result.stdout.splitlines()
        assert lines[0].startswith("NOT ANSWERING: vLLM process group")  # the swap is no longer first
        assert f"  rollback to: org/m@{'a' * 12} (`rollout rollback`)" in lines  # it serves: the one before it
    finally:
        os.killpg(alive, signal.SIGKILL)

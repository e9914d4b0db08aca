"""The swap as a recorded transaction, guarded by a process that outlives the deploy.

From the moment a deploy stops the host's server until the next server is promoted (or the last good
one restored), `swap.json` in the run directory says which deploy owns the swap. A guard process, in
a session of its own, watches that deploy: if it dies (kill -9, a power cut of its machine's
container, an OOM kill) while the record stands, the guard stops any server that was never promoted,
within half a second (a vLLM load takes minutes, so an unchecked model never answers), and brings
the last good deployment back through `rollout recover`, retrying while the dead deploy's lease on
the host lock lapses. A deploy that ends in any other way, SIGTERM and Ctrl-C included, closes the
record itself.

Why a guard and not a fence port: a second port behind a proxy would add a hop to every request of
the production server for the minutes a swap takes once a night; the guard costs one idle process
during the swap and nothing after it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tasks.trust import read_state_text
from tasks.vllm.process import process_start_time, stop_group, vllm_group

POLL_S = 0.5
RECOVER_FOR_S = 600.0  # the dead deploy's lease on the host lock lapses within about 75 s
RECOVER_EVERY_S = 15.0


def swap_file(run_dir: Path) -> Path:
    return run_dir / "swap.json"


def write_record(path: Path, record: dict) -> None:
    """Write, fsync, rename: a power cut leaves the old record or the new one, never half of one."""
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as out:
        out.write(json.dumps(record))
        out.flush()
        os.fsync(out.fileno())
    tmp.replace(path)


def begin_swap(run_dir: Path, *, what: str, models_root: Path, flow_run_id: str | None = None) -> None:
    """Record that this process (and its flow run, when it is one) now owns the host's swap, and
    start its guard."""
    run_dir.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    write_record(swap_file(run_dir), {"deploy_pid": pid, "deploy_started": process_start_time(pid), "what": what,
                                "models_root": str(models_root), "since": time.time(), "flow_run_id": flow_run_id})
    log = (run_dir / "swap-guard.log").open("ab")
    subprocess.Popen([sys.executable, "-m", "tasks.history.swap", str(run_dir)], stdin=subprocess.DEVNULL,
                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)


def end_swap(run_dir: Path) -> None:
    """The swap ended in a server that passed its checks, or in the last good one restored: the
    guard has nothing left to watch."""
    swap_file(run_dir).unlink(missing_ok=True)


def owner_alive(record: dict) -> bool:
    """Whether the process a record names (`deploy_pid`, `deploy_started`) still runs."""
    started = process_start_time(int(record["deploy_pid"]))
    return started is not None and started == record.get("deploy_started")


def abandoned_swap(run_dir: Path) -> dict | None:
    """The record of a swap whose owner died before closing it: the run that is to be marked crashed."""
    record = _read(run_dir)
    return record if record is not None and not owner_alive(record) else None


def _read(run_dir: Path) -> dict | None:
    """The record, or None where there is none or it is not one this host wrote (bounded, an object
    naming a positive integer pid): a guard acts on nothing it cannot read."""
    try:
        record = json.loads(read_state_text(swap_file(run_dir)))
    except (FileNotFoundError, ValueError):
        return None
    pid = record.get("deploy_pid") if isinstance(record, dict) else None
    return record if type(pid) is int and pid > 0 else None


def stop_unpromoted(run_dir: Path) -> int | None:
    """Stop the server recorded in server.json unless last-good.json says it serves the last good
    deployment; returns the stopped process group. Read as plain JSON: a guard must act on what it
    can read, whatever else is damaged."""
    try:
        pgid = json.loads(read_state_text(run_dir / "server.json"))["pgid"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        promoted = json.loads(read_state_text(run_dir / "last-good.json")).get("serving_pgid")
    except (OSError, ValueError, AttributeError):
        promoted = None
    if pgid == promoted or not vllm_group(pgid):  # never init's, its own, or a group that runs no vLLM
        return None
    stop_group(pgid, grace_s=2.0)
    return pgid


def guard(run_dir: Path) -> None:
    """Watch the swap's owner; when it dies mid-swap, stop what was never promoted, then recover."""
    while (record := _read(run_dir)) is not None and owner_alive(record):
        time.sleep(POLL_S)
    if record is None:
        return  # the deploy closed the swap itself
    stopped = stop_unpromoted(run_dir)
    print(f"{time.strftime('%H:%M:%S')} deploy pid {record['deploy_pid']} died mid-swap ({record['what']}); "
          f"unpromoted server {stopped or 'none'} stopped; restoring the last good deployment", flush=True)
    deadline = time.monotonic() + RECOVER_FOR_S
    while time.monotonic() < deadline and _read(run_dir) == record:  # a new deploy owning the swap ends this
        done = subprocess.run([sys.executable, "-m", "flows.cli", "recover", "--models-root", record["models_root"]],
                              capture_output=True, text=True)
        print(done.stdout.strip() or done.stderr.strip(), flush=True)
        if done.returncode == 0 or "another deploy is running" not in done.stderr:
            break
        time.sleep(RECOVER_EVERY_S)
    if _read(run_dir) == record:
        end_swap(run_dir)


if __name__ == "__main__":
    guard(Path(sys.argv[1]))

"""One deploy per GPU host, enforced by a Prefect global concurrency limit.

The nightly refresh and a redeploy from the UI must never both drive the same GPUs: the second
would reap the first's server as "stale". The limit is strict (a missing limit is an error, not
a free pass) and leased, so a deploy that dies without releasing frees the host when its lease
lapses instead of blocking it until someone logs in.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from uuid import UUID

import httpx
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound, PrefectHTTPStatusError
from prefect.states import Crashed

from tasks.errors import HostBusyError, first_line
from tasks.history.swap import owner_alive, write_record
from tasks.host import host_name
from tasks.vllm.process import process_start_time

LEASE_S = 60.0  # renewed while the deploy lives; a deploy killed with SIGKILL frees the host after this


def limit_name(host: str | None = None) -> str:
    host = host or host_name()
    return "vllm-host-" + re.sub(r"[^a-z0-9-]+", "-", host.lower()).strip("-")


def _taken(name: str) -> bool:
    """Whether another deploy holds the host's slot. The limit is created on first use; read first,
    since a create that collides is refused by the server with an IntegrityError traceback in its
    log (the demo's output, on the embedded server). Leases that lapsed and that no server service
    revoked are revoked first (`_revoke_lapsed`)."""
    with get_client(sync_client=True) as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:  # two deploys starting at once may both find none
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
            except ObjectAlreadyExists:
                pass
            return False
        if limit.active_slots >= limit.limit and _revoke_lapsed(client, limit.id):
            limit = client.read_global_concurrency_limit_by_name(name)
    return limit.active_slots >= limit.limit


LEASE_INDEX_MAX = 16 * 2**20  # Prefect's lease index on disk: one line per lease, ~100 bytes each


def _revoke_lapsed(client, limit_id: UUID) -> int:
    """What Prefect's repossessor service does, for this limit only, where no server runs it.

    Prefect's embedded server (the CLI's default: started for each command) runs none of its
    services, so the lease of a deploy that died (a killed `make demo`, a power cut) outlived its
    expiry and held the host for ever: every later deploy was refused as "another deploy is running".
    Its leases are files in this machine's PREFECT_HOME (the CLI keeps them on disk); each one that
    lapsed and holds this limit is released through the API, which revokes it as the repossessor
    would. A server elsewhere keeps its leases elsewhere: nothing here names its limit, and its own
    repossessor runs. Returns how many were released."""
    from prefect.settings import get_current_settings

    leases = Path(get_current_settings().home) / "concurrency_leases"
    try:
        with open(leases / "expirations.json", "rb") as index_file:
            index = json.loads(index_file.read(LEASE_INDEX_MAX + 1)[:LEASE_INDEX_MAX])
    except (OSError, ValueError):
        return 0
    now = time.time()
    released = 0
    for lease_id, expiration in index.items() if isinstance(index, dict) else ():
        try:
            lapsed = datetime.fromisoformat(str(expiration)).timestamp() < now
            held = json.loads((leases / f"{UUID(lease_id)}.json").read_text()[:65536]) if lapsed else {}
        except (OSError, ValueError):
            continue
        if str(limit_id) in (held.get("resource_ids") or []):
            try:
                client.release_concurrency_slots_with_lease(UUID(lease_id))
                released += 1
            except PrefectHTTPStatusError:
                continue
    if released:
        logging.getLogger(__name__).warning("revoked %d lapsed lease(s) of the host lock, left by a deploy that died "
                                            "where no Prefect service revokes them", released)
    return released


def _holder_file(run_dir: Path) -> Path:
    return run_dir / "lock.json"


def _free_dead_holder(run_dir: Path) -> str | None:
    """Free the host from a deploy that died holding its lock (kill -9, OOM): its lease is released at
    once, not when it lapses, and its run is marked crashed. Returns the dead run's id or pid."""
    try:
        held = json.loads(_holder_file(run_dir).read_text())
    except (FileNotFoundError, ValueError):
        return None
    if owner_alive(held):
        return None
    with get_client(sync_client=True) as client:
        try:
            client.release_concurrency_slots_with_lease(UUID(held["lease_id"]))
        except (PrefectHTTPStatusError, KeyError, ValueError):
            pass  # lapsed already, or released by another look
    mark_crashed(held)
    _holder_file(run_dir).unlink(missing_ok=True)
    return held.get("flow_run_id") or f"pid {held.get('deploy_pid')}"


def mark_crashed(record: dict | None) -> str | None:
    """A run whose process died (kill -9) stays Running forever, since nothing is left to report
    for it: it is marked Crashed, naming why. Returns its id where one was marked."""
    run_id = record.get("flow_run_id") if record else None
    if not run_id:
        return None
    with get_client(sync_client=True) as client:
        try:
            if client.read_flow_run(run_id).state.is_final():
                return None
            client.set_flow_run_state(run_id, Crashed(message=f"its process (pid {record.get('deploy_pid')}) died "
                                                              f"({record.get('what', 'holding the host lock')}); "
                                                              "the host went on without it"), force=True)
        except (ObjectNotFound, PrefectHTTPStatusError):  # a run of another Prefect server: not ours to mark
            return None
    return run_id


@contextmanager
def host_lock(host: str | None = None, wait_s: float = 5.0, run_dir: Path | None = None) -> Iterator[str]:
    """Hold the host's single slot for the block; refuse when another deploy holds it for `wait_s`.

    Busy is read off the limit's taken slots, not off a slow acquisition: under load (SQLite, three
    workers polling) the server took more than 5 s to grant a free slot, and the host was called busy.
    With `run_dir`, the holder is recorded there (lock.json: pid, start time, lease, flow run), so a
    later look frees a lock whose holder died instead of waiting for its lease to lapse; Prefect's
    embedded server runs no service that revokes lapsed leases at all.
    """
    name = limit_name(host)
    freed = _free_dead_holder(run_dir) if run_dir is not None else None
    deadline = time.monotonic() + wait_s
    while _taken(name):
        if time.monotonic() > deadline:
            raise _busy(name)
        time.sleep(1.0)
    with get_client(sync_client=True) as client:
        try:
            granted = client.increment_concurrency_slots_with_lease(names=[name], slots=1, mode="concurrency",
                                                                    lease_duration=LEASE_S)
        except PrefectHTTPStatusError as exc:  # another deploy took the slot between the look and the grant
            raise _busy(name) from exc
    lease_id = UUID(granted.json()["lease_id"])
    if freed:
        logging.getLogger(__name__).warning("freed host lock %s from %s, which died holding it", name, freed)
    stop = threading.Event()
    renewer = threading.Thread(target=_renew, args=(lease_id, stop), name="host-lock-lease", daemon=True)
    renewer.start()
    if run_dir is not None:
        _record_holder(run_dir, lease_id)
    try:
        yield name
    finally:
        stop.set()
        renewer.join(timeout=10)
        if run_dir is not None:
            _holder_file(run_dir).unlink(missing_ok=True)
        try:
            with get_client(sync_client=True) as client:
                client.release_concurrency_slots_with_lease(lease_id)
        except PrefectHTTPStatusError:
            pass  # the lease lapsed while the API was away: the slot is free already
        except httpx.HTTPError as exc:  # the API is away: the lease lapses by itself, and the run's error stands
            logging.getLogger(__name__).warning(
                "host lock %s not released (%s): its lease lapses %d s after its last renewal", name, first_line(exc),
                LEASE_S)


def _renew(lease_id: UUID, stop: threading.Event) -> None:
    """Renew the lease every third of its life while the block runs; a missed renewal is tried again
    at the next turn (the lease outlives two misses)."""
    while not stop.wait(LEASE_S / 3):
        try:
            with get_client(sync_client=True) as client:
                client.renew_concurrency_lease(lease_id, lease_duration=LEASE_S)
        except Exception as exc:  # the API away for a moment: the next turn tries again
            logging.getLogger(__name__).warning("host lock lease not renewed: %s", exc)


def _record_holder(run_dir: Path, lease_id: UUID) -> None:
    """lock.json: who holds the host's slot, in the swap record's terms, so one liveness check reads both."""
    from prefect.runtime import flow_run

    pid = os.getpid()
    run_dir.mkdir(parents=True, exist_ok=True)
    write_record(_holder_file(run_dir), {"deploy_pid": pid, "deploy_started": process_start_time(pid),
                                         "lease_id": str(lease_id),
                                         "flow_run_id": str(flow_run.get_id() or "") or None})


def _busy(name: str) -> HostBusyError:
    return HostBusyError(f"another deploy is running on this host (Prefect concurrency limit {name} is full): wait "
                         f"for it to finish or cancel it; a deploy that died frees the host when its lease lapses, "
                         f"{LEASE_S:.0f}-{LEASE_S + 15:.0f} s after it died")

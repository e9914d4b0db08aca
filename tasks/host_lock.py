"""One deploy per GPU host, enforced by a Prefect global concurrency limit.

The nightly refresh and a redeploy from the UI must never both drive the same GPUs: the second
would reap the first's server as "stale". The limit is strict (a missing limit is an error, not
a free pass) and leased, so a deploy that dies without releasing frees the host when its lease
lapses instead of blocking it until someone logs in.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from tasks.errors import HostBusyError
from tasks.host import host_name

LEASE_S = 60.0  # renewed while the deploy lives; a deploy killed with SIGKILL frees the host after this
GRANT_S = 60.0  # for the server to grant a free slot: its answers wait on the database under load


def limit_name(host: str | None = None) -> str:
    host = host or host_name()
    return "vllm-host-" + re.sub(r"[^a-z0-9-]+", "-", host.lower()).strip("-")


def _taken(name: str) -> bool:
    """Whether another deploy holds the host's slot. The limit is created on first use; read first,
    since a create that collides is refused by the server with an IntegrityError traceback in its
    log (the demo's output, on the embedded server)."""
    with get_client(sync_client=True) as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:  # two deploys starting at once may both find none
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
            except ObjectAlreadyExists:
                pass
            return False
    return limit.active_slots >= limit.limit


@contextmanager
def host_lock(host: str | None = None, wait_s: float = 5.0) -> Iterator[str]:
    """Hold the host's single slot for the block; refuse when another deploy holds it for `wait_s`.

    Busy is read off the limit's taken slots, not off a slow acquisition: under load (SQLite, three
    workers polling) the server took more than 5 s to grant a free slot, and the host was called busy.
    """
    name = limit_name(host)
    deadline = time.monotonic() + wait_s
    while _taken(name):
        if time.monotonic() > deadline:
            raise _busy(name)
        time.sleep(1.0)
    with ExitStack() as held:
        try:  # only the acquisition: a TimeoutError from inside the block is the block's own
            held.enter_context(concurrency(name, occupy=1, timeout_seconds=GRANT_S, strict=True,
                                           lease_duration=LEASE_S))
        except TimeoutError as exc:  # another deploy took the slot between the look and the grant
            raise _busy(name) from exc
        yield name


def _busy(name: str) -> HostBusyError:
    return HostBusyError(f"another deploy is running on this host (Prefect concurrency limit {name} is full): wait "
                         f"for it to finish or cancel it; a deploy that died frees the host when its lease lapses, "
                         f"{LEASE_S:.0f}-{LEASE_S + 15:.0f} s after it died")

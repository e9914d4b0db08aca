"""The host lock survives a Prefect server restart: a deploy that died with the server frees the
host when its lease lapses, not "until someone steps in" (a real `prefect server start`, killed
with SIGKILL and started again on the same home and port)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from prefect.settings import PREFECT_API_URL, temporary_settings

from tasks.orchestration.host_lock import LEASE_S, host_lock
from testkit.prefect_processes import free_port, prefect_server

HOLD = """
import sys, time
from tasks.orchestration.host_lock import host_lock
with host_lock("restart-test"):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_restarted_server_frees_a_dead_deploys_host_within_two_minutes(tmp_path):
    port = free_port()
    with prefect_server(tmp_path, port=port) as (url, _):
        env = {**os.environ, "PREFECT_API_URL": url}
        holder = subprocess.Popen([sys.executable, "-c", HOLD], env=env, stdout=subprocess.PIPE, text=True,
                                  start_new_session=True)
        assert holder.stdout.readline().strip() == "held"
        with temporary_settings({PREFECT_API_URL: url}):  # the slot is taken: a second deploy is refused
            try:
                with host_lock("restart-test", wait_s=2):
                    raise AssertionError("the host lock was granted twice")
            except Exception as exc:
                assert type(exc).__name__ == "HostBusyError", exc
        # The server dies mid-deploy, and the deploy with it (its API gone, or kill -9 on the box).
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    died = time.monotonic()
    with prefect_server(tmp_path, port=port) as (url, _), temporary_settings({PREFECT_API_URL: url}):
        while True:
            try:
                with host_lock("restart-test", wait_s=5):
                    break
            except Exception as exc:
                assert type(exc).__name__ == "HostBusyError", exc
                assert time.monotonic() - died < 120, f"the host is still locked {time.monotonic() - died:.0f} s after"
        freed = time.monotonic() - died
    print(f"host lock free again {freed:.0f} s after the deploy died (lease {LEASE_S:.0f} s)")
    assert freed < 120


EMBEDDED_HOLD = """
import time
import flows.cli.common  # the CLI's environment: Prefect's embedded server, leases on disk
from tasks.orchestration.host_lock import host_lock
with host_lock("embedded-test"):
    print("held", flush=True)
    time.sleep(600)
"""
EMBEDDED_TAKE = """
import flows.cli.common
from tasks.orchestration.host_lock import host_lock
try:
    with host_lock("embedded-test", wait_s=3):
        print("granted")
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_on_the_embedded_server_a_dead_deploys_lapsed_lease_frees_the_host(tmp_path):
    """`make demo` killed mid-deploy, then run again: Prefect's embedded server (no PREFECT_API_URL,
    started for each command) runs no repossessor, so the dead deploy's lease, lapsed, still held the
    host, and every later deploy on the machine was refused as busy. The lapse is simulated by dating
    the lease 2 minutes back in Prefect's own files (instead of waiting its 60 s out)."""
    import json
    from datetime import datetime, timedelta, timezone

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    holder = subprocess.Popen([sys.executable, "-c", EMBEDDED_HOLD], env=env, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    assert holder.stdout.readline().strip() == "held"
    os.killpg(holder.pid, signal.SIGKILL)  # the deploy and its embedded server, at once
    holder.wait(timeout=30)
    leases = tmp_path / "prefect-home" / "concurrency_leases"
    lapsed = (datetime.now(timezone.utc) - timedelta(minutes=2)).isoformat()
    index = json.loads((leases / "expirations.json").read_text())
    for lease_id in index:
        lease = json.loads((leases / f"{lease_id}.json").read_text())
        (leases / f"{lease_id}.json").write_text(json.dumps({**lease, "expiration": lapsed}))
    (leases / "expirations.json").write_text(json.dumps({lease_id: lapsed for lease_id in index}))
    taken = subprocess.run([sys.executable, "-c", EMBEDDED_TAKE], env=env, capture_output=True, text=True,
                           timeout=120)
    assert taken.stdout.strip().splitlines()[-1] == "granted", taken.stdout + taken.stderr

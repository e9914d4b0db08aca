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

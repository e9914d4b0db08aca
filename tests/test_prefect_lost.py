"""A Prefect API that goes away mid-run (issue 40, item 4): the command ends with one line naming
the API's URL and what the host serves now, exit 2; no traceback, no events-worker dump in the
terminal. A real `prefect server start`, killed -9 while `rollout prepare` fetches from a slow hub."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from flows.demo import BF16_REPO
from testkit.faulty_hub import FaultyHub
from testkit.prefect_processes import prefect_server


def test_the_prefect_api_lost_mid_run_is_one_line_naming_it_and_what_the_host_serves(hub_root, tmp_path):
    models = tmp_path / "models"
    with prefect_server(tmp_path) as (url, _), FaultyHub(hub_root) as hub:
        hub.throttle_bps = 400_000  # the demo's weights take ~25 s: the API goes away meanwhile
        env = {**os.environ, "PREFECT_API_URL": url, "HF_ENDPOINT": hub.endpoint, "PREFECT_CLIENT_MAX_RETRIES": "2"}
        run = subprocess.Popen([sys.executable, "-m", "flows.cli", "prepare", BF16_REPO, "--models-root", str(models)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 180
        while max(hub.bytes_sent_by_file.values(), default=0) < 200_000:  # the weights' fetch under way
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            time.sleep(0.2)
        server = next(p for p in _children_listening(url))
        os.killpg(server, signal.SIGKILL)
        out, err = run.communicate(timeout=300)
    lines = err.splitlines()
    assert run.returncode == 2, err[-3000:]
    assert lines[-1].startswith(f"error: the Prefect API at {url} went away mid-run ("), lines[-1]
    assert lines[-1].endswith(f"; this host: nothing serves: no server recorded in {models / '.rollout' / 'server.json'}")
    assert "Traceback" not in err and "EventsWorker" not in err, err[-3000:]


def _children_listening(url: str):
    """The process group of the Prefect server listening on the URL's port (started in a session of its own)."""
    port = url.rsplit(":", 1)[1].split("/")[0]
    found = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True).stdout
    for pid in {int(p.split("=")[1]) for p in found.replace(",", " ").split() if p.startswith("pid=")}:
        yield os.getpgid(pid)

"""A Prefect API that goes away mid-run (issue 40, item 4): the command ends with one line naming
the API's URL and what the host serves now, exit 2; no traceback, no events-worker dump in the
terminal. A real `prefect server start`, killed -9 while `rollout prepare` fetches from a slow hub.

And the embedded server's own logs (issue 40, item 6): to a file, named in one line where it logged
an error, never in the user's terminal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from flows.cli.embedded_server import errors_since, server_logging_config
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


def test_the_embedded_servers_logs_go_to_a_file_not_the_terminal(tmp_path):
    """A real command on the embedded server, its server made talkative (INFO): the server's lines
    are in the file, none in the terminal; the command's own flow-run lines stay in the terminal."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_LOGGING_SETTINGS_PATH")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), TMPDIR=str(tmp_path), PREFECT_SERVER_LOGGING_LEVEL="INFO")
    run = subprocess.run([sys.executable, "-m", "flows.cli", "stop", "--models-root", str(tmp_path / "models")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Flow run" in run.stderr and "nothing was running" in run.stdout
    for server_logger in ("uvicorn", "prefect.server"):
        assert f"| {server_logger}" not in run.stderr, run.stderr[-3000:]
    logged = (tmp_path / "rollout-prefect-server.log").read_text()
    assert "| uvicorn.error - Started server process" in logged and "| prefect.server." in logged, logged[-2000:]
    assert "note: Prefect's embedded server logged" not in run.stderr  # no error: no note


def test_an_error_the_embedded_server_logged_is_counted_from_where_the_command_began(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("12:00:00.000 | ERROR   | prefect.server.services.triggers - an older command's\n")
    start = log.stat().st_size
    with log.open("a") as f:
        f.write("12:00:01.000 | INFO    | prefect.server.api - fine\n"
                "12:00:02.000 | ERROR   | prefect.server.events.triggers - sqlite3.OperationalError: database is locked\n"
                "Traceback (most recent call last):\n  File ...\n"
                "12:00:03.000 | CRITICAL | uvicorn.error - gone\n")
    assert errors_since(log, start) == 2
    assert errors_since(log, 0) == 3
    assert errors_since(tmp_path / "absent.log", 0) == 0


def test_the_servers_loggers_leave_the_console_and_everything_else_is_prefects_own():
    default = {"handlers": {"console": {"class": "x"}}, "loggers": {"uvicorn": {"level": "INFO", "handlers": ["console"]},
                                                                     "prefect.flow_runs": {"handlers": ["api"]}},
               "root": {"handlers": ["console"]}}
    config = server_logging_config(default, log_file=__import__("pathlib").Path("/x/server.log"))
    assert config["loggers"]["uvicorn"] == {"level": "INFO", "handlers": ["rollout_server_file"], "propagate": False}
    assert config["loggers"]["prefect.server"]["handlers"] == ["rollout_server_file"]
    assert config["loggers"]["prefect.flow_runs"] == {"handlers": ["api"]} and config["root"] == default["root"]
    assert config["handlers"]["rollout_server_file"]["filename"] == "/x/server.log"
    assert default["loggers"]["uvicorn"]["handlers"] == ["console"]  # Prefect's own dict is not changed

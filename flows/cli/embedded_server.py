"""The embedded Prefect server's own logs go to a file, never to the user's terminal.

Without PREFECT_API_URL, Prefect starts its server as a subprocess of the command, and that process
inherits the terminal: a service's error in it (the triggers service's `sqlite3.OperationalError:
database is locked` on a loaded machine) printed a full traceback into `make demo`'s output, while
the run went on and passed. The server is configured by Prefect's own logging file
(PREFECT_LOGGING_SETTINGS_PATH): we hand it Prefect's default, with the server's loggers sent to a
file of ours, and name that file in one line when the server logged an error during the command.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
from pathlib import Path

import yaml

SERVER_LOG = Path(os.environ.get("TMPDIR", "/tmp")) / "rollout-prefect-server.log"
# The server's loggers, and the web stack it runs on; the root logger stays on the console, so the
# command's own (in-process) logs are unchanged.
SERVER_LOGGERS = ("prefect.server", "uvicorn", "fastapi")
ERROR_LINE = re.compile(r"\| (ERROR|CRITICAL) ")


def server_logging_config(default: dict, log_file: Path) -> dict:
    """Prefect's logging config, less the terminal for the server's loggers: they write to `log_file`."""
    config = {**default, "handlers": {**default.get("handlers", {})}, "loggers": {**default.get("loggers", {})}}
    config["handlers"]["rollout_server_file"] = {
        "level": 0, "class": "logging.FileHandler", "formatter": "standard", "filename": str(log_file),
        "delay": True,
    }
    for name in SERVER_LOGGERS:
        config["loggers"][name] = {**config["loggers"].get(name, {}), "handlers": ["rollout_server_file"],
                                   "propagate": False}
    return config


def route_server_logs(log_file: Path = SERVER_LOG) -> None:
    """Before the embedded server starts: its logs to `log_file`, and one line at exit naming that
    file where the server logged an error meanwhile. A logging file the user set is theirs: kept."""
    if os.environ.get("PREFECT_LOGGING_SETTINGS_PATH"):
        return
    import prefect.logging

    default = yaml.safe_load((Path(prefect.logging.__file__).parent / "logging.yml").read_text())
    settings = log_file.with_suffix(".logging.yml")
    try:
        settings.write_text(yaml.safe_dump(server_logging_config(default, log_file)))
    except OSError:  # no writable TMPDIR: the server's logs stay on the terminal, as Prefect has them
        return
    # Read by the server's subprocess only: it inherits this environment when the flow first calls the
    # API; this process configured its own logging when Prefect was imported.
    os.environ["PREFECT_LOGGING_SETTINGS_PATH"] = str(settings)
    start = log_file.stat().st_size if log_file.exists() else 0
    atexit.register(lambda: _name_errors(log_file, start))


def errors_since(log_file: Path, start: int) -> int:
    """How many ERROR or CRITICAL records the server wrote to `log_file` after byte `start` (bounded read)."""
    try:
        with log_file.open("rb") as f:
            f.seek(start)
            text = f.read(8 << 20).decode("utf-8", "replace")
    except OSError:
        return 0
    return sum(1 for line in text.splitlines() if ERROR_LINE.search(line))


def _name_errors(log_file: Path, start: int) -> None:
    if errors := errors_since(log_file, start):
        print(f"note: Prefect's embedded server logged {errors} error{'s' * (errors > 1)} during this command, "
              f"in its own services, not in the run: {log_file}", file=sys.stderr)

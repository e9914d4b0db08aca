"""A hub that does not answer: one line naming the endpoint, exit 2 (unusable input), no traceback.

Four ways a hub fails to answer at 2 AM or after a typo: nothing listens, the name does not
resolve, TLS fails (https to a plain-HTTP port), and a server that accepts and never replies.
"""

from __future__ import annotations

import socket
import threading

import pytest
from conftest import artifact
from huggingface_hub import constants
from typer.testing import CliRunner

import flows.nightly
from flows.cli import app
from flows.demo import demo_config
from flows.nightly import nightly_refresh
from tasks.errors import HubUnreachable

runner = CliRunner()


@pytest.fixture
def silent_port():
    """A port that accepts connections and never says a word."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    held = []
    threading.Thread(target=lambda: [held.append(sock.accept()) for _ in range(64)], daemon=True).start()
    yield sock.getsockname()[1]
    sock.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(params=["refused", "dns", "tls", "timeout"])
def dead_endpoint(request, local_hub, silent_port, monkeypatch):
    """(endpoint, what the line must say)."""
    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 1)
    host_port = local_hub.endpoint.removeprefix("http://")
    return {
        "refused": (f"http://127.0.0.1:{_closed_port()}", "connection refused"),
        "dns": ("http://no-such-host.invalid", "host name not resolved"),
        "tls": (f"https://{host_port}", "TLS handshake failed"),
        "timeout": (f"http://127.0.0.1:{silent_port}", "no answer within 1 s"),
    }[request.param]


def _one_line(result, endpoint: str, what: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: Hub unreachable at {endpoint}: {what}"), lines[0]


def test_validate_names_an_unreachable_hub(dead_endpoint):
    endpoint, what = dead_endpoint
    _one_line(runner.invoke(app, ["validate", "demo/tiny-moe", "--endpoint", endpoint]), endpoint, what)


def test_deploy_names_an_unreachable_hub_before_anything_starts(dead_endpoint, tmp_path):
    endpoint, what = dead_endpoint
    result = runner.invoke(app, ["deploy", "demo/tiny-moe", "--endpoint", endpoint, "--models-root", str(tmp_path)])
    _one_line(result, endpoint, what)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.usefixtures("prefect_server")
def test_nightly_says_hub_unreachable_in_its_artifact(tmp_path, monkeypatch):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    # The task's own retries (2, 10, 30 s) are for a hub outage; this test needs only the last answer.
    monkeypatch.setattr(flows.nightly, "resolve_revision", flows.nightly.resolve_revision.with_options(retries=0))
    with pytest.raises(HubUnreachable, match=f"^Hub unreachable at {endpoint}: connection refused"):
        nightly_refresh(demo_config(endpoint, tmp_path / "models"))
    text = artifact("nightly-demo-tiny-moe").data
    assert f"**Hub unreachable:** Hub unreachable at {endpoint}: connection refused" in text
    assert "Traceback" not in text and "nothing was downloaded" in text.lower()

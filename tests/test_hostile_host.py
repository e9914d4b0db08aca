"""The rest of issue 38's attack list, around a host rather than a hub: the mirror's clients, the
demo hub's URLs, the host's own state files (what `rollout status` reads and the swap guard may
stop), a model repo's answer probes, and a vLLM that listens beyond loopback without a key.

Each failed on the code before issue 38 (docs/security.md). The state-file tests replace
os.killpg with a recorder, so that code under test that would signal init's group, or the test's
own, records it instead of doing it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_hostile import ROLLOUT, deadline, honest, hostile, one_line, run  # noqa: F401 (fixtures)
from testkit.prefect_processes import wait_healthy

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rollout_mirror_beyond_loopback_asks_for_the_fleet_token_and_says_whom_it_serves(hostile, tmp_path,
                                                                                          monkeypatch):
    from tasks.hub import fetch_file, resolve_snapshot

    hostile.fake("org/m", honest())
    snap = resolve_snapshot("org/m", "main", hostile.endpoint)
    for f in snap.files:  # a canary's cache: one verified commit
        fetch_file(snap, f, tmp_path / "models" / "hub", endpoint=hostile.endpoint)
    port = _free_port()
    mirror = [ROLLOUT, "mirror", "--models-root", str(tmp_path / "models"), "--host", "0.0.0.0", "--port", str(port)]
    refused = run(mirror, timeout=30)
    assert refused.rc == 2, refused
    one_line(refused, "--host 0.0.0.0", "ROLLOUT_MIRROR_TOKEN", "--anonymous")

    token = "fleet-mirror-token"
    served = subprocess.Popen(mirror, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**os.environ, "ROLLOUT_MIRROR_TOKEN": token})
    try:
        wait_healthy(served, f"http://127.0.0.1:{port}")
        url = f"http://127.0.0.1:{port}/org/m/resolve/{snap.commit}/config.json"
        assert httpx.get(url).status_code == 401  # an anonymous curl gets nothing, gated or not
        assert httpx.get(url, headers={"Authorization": "Bearer guess"}).status_code == 401
        keyed = {"Authorization": f"Bearer {token}"}
        assert httpx.get(url, headers=keyed).status_code == 200
        for bad in ("bytes=-", "bytes=5-3"):
            assert httpx.get(url, headers=keyed | {"Range": bad}).status_code == 416, bad
        # a range it cannot parse is ignored, as HTTP says: the whole file, not a dropped connection
        assert httpx.get(url, headers=keyed | {"Range": "bytes=" + "9" * 5000 + "-"}).status_code == 200
        config = next(f for f in snap.files if f.path == "config.json")
        mirrored = f"http://127.0.0.1:{port}"
        monkeypatch.delenv("ROLLOUT_MIRROR_TOKEN", raising=False)  # a host after the canary without the token
        without = fetch_file(snap, config, tmp_path / "a" / "hub", endpoint=hostile.endpoint, mirror=mirrored)
        assert without.source == "hub" and "set ROLLOUT_MIRROR_TOKEN" in without.mirror_error, without
        monkeypatch.setenv("ROLLOUT_MIRROR_TOKEN", token)
        assert fetch_file(snap, config, tmp_path / "b" / "hub", endpoint=hostile.endpoint,
                          mirror=mirrored).source == "mirror"
    finally:
        served.terminate()
        out, err = served.communicate(timeout=30)
    start = err.strip().splitlines()[0]
    assert f"org/m@{snap.commit[:12]}" in start and "mirror token (ROLLOUT_MIRROR_TOKEN)" in start, start
    assert f"from any host that reaches 0.0.0.0:{port}" in start and "Traceback" not in err


def test_the_demo_hub_serves_no_repo_outside_its_root(tmp_path):
    from flows.demo.hub_server import LocalHub

    root = tmp_path / "a" / "b" / "root"
    (root / "org" / "m").mkdir(parents=True)
    (root / "org" / "m" / "config.json").write_text("{}")
    (tmp_path / "a" / "secret.txt").write_text("the operator's secret")
    with LocalHub(root) as hub:
        assert httpx.get(f"{hub.endpoint}/api/models/org/m").status_code == 200
        for path in ("/api/models/%2e%2e/%2e%2e", "/%2e%2e/%2e%2e/resolve/main/secret.txt", "/api/models/org/%2e%2e"):
            answer = httpx.get(hub.endpoint + path)
            assert answer.status_code == 404 and b"secret" not in answer.content, path


@pytest.fixture
def signals(monkeypatch) -> list[tuple[int, int]]:
    """os.killpg recorded, not done: what the code under test would have signalled."""
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: sent.append((pgid, sig)))
    return sent


@pytest.mark.parametrize("pgid", [1, 0, -1, True, "own"], ids=["init", "zero", "minus-one", "true", "own-group"])
def test_a_state_file_naming_init_the_callers_group_or_everyone_is_never_signalled(tmp_path, signals, pgid):
    from tasks.history.swap import stop_unpromoted
    from tasks.vllm.process import reap_stale, serving_group, stop_group

    pgid = os.getpgrp() if pgid == "own" else pgid
    (tmp_path / "server.json").write_text(json.dumps({"pid": 123, "pgid": pgid, "command": ["vllm", "serve"]}))
    assert serving_group(tmp_path / "server.json") is None
    assert stop_unpromoted(tmp_path) is None  # the swap guard's stop: it checked for a group, not for vLLM
    reap_stale(tmp_path / "server.json", grace_s=0.1)
    with pytest.raises(ValueError, match="not one to stop"):
        stop_group(pgid, grace_s=0.1)
    assert signals == []


def test_the_swap_guard_never_stops_a_group_that_runs_no_vllm(tmp_path, signals):
    from tasks.history.swap import stop_unpromoted

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        (tmp_path / "server.json").write_text(json.dumps({"pid": other.pid, "pgid": other.pid, "command": []}))
        assert stop_unpromoted(tmp_path) is None and signals == []
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("content, words", [
    ("[]", ["damaged", "not the object a launch writes"]),
    ('{"pgid": "1; rm -rf /", "command": []}', ["damaged"]),
    ("64 MB", ["damaged", "more than 16,777,216 bytes"]),  # written in the test: not held by pytest
], ids=["a-list", "pgid-text", "64-MB"])
def test_rollout_status_on_a_state_file_this_host_did_not_write_is_one_line(tmp_path, content, words):
    run_dir = tmp_path / "models" / ".rollout"
    run_dir.mkdir(parents=True)
    if content == "64 MB":
        content = '{"pgid": 4, "pad": "' + "A" * (64 * 2**20) + '"}'
    (run_dir / "server.json").write_text(content)
    del content
    ran = run([ROLLOUT, "status", "--models-root", str(tmp_path / "models")])
    assert ran.rc == 2, ran
    one_line(ran, "server.json", *words)
    assert ran.peak_mb < 200, ran.peak_mb  # the command's own ~120 MB; the record's 64 MB are never held


def test_answer_probes_a_model_repo_ships_are_bounded(tmp_path):
    from tasks.answers.check import load_probes
    from tasks.errors import UnusableInput

    def probes(n: int, expected=lambda i: str(i + 1)) -> Path:
        path = tmp_path / f"probes-{n}.jsonl"
        path.write_text("\n".join(json.dumps({"prompt": f"{i} + 1 =", "expected": expected(i)}) for i in range(n)))
        return path

    started = time.monotonic()
    with pytest.raises(UnusableInput, match=r"more than 1,048,576 bytes") as huge:
        load_probes(probes(100_000))  # asked one by one, they took hours
    from tasks.answers.check import MAX_PROBES  # the stated bound

    with pytest.raises(UnusableInput, match=f"more than {MAX_PROBES} probes") as many:
        load_probes(probes(MAX_PROBES + 1))
    with pytest.raises(UnusableInput, match="blank expected answer passes any output") as blank:
        load_probes(probes(3, expected=lambda i: "  "))
    assert time.monotonic() - started < 10
    assert all("\n" not in str(e.value) for e in (huge, many, blank))
    assert len(load_probes(probes(MAX_PROBES))) == MAX_PROBES


def test_vllm_beyond_loopback_without_a_key_is_one_warning_line_and_the_shipped_hosts_file_sets_a_key():
    from tasks.deployment.config import DeployConfig
    from tasks.fleet.hosts import HostsFile

    warning = DeployConfig(repo_id="org/m", host="0.0.0.0", port=8000).exposure_warning()
    assert warning and "\n" not in warning and "0.0.0.0:8000" in warning and "api_key_secret" in warning
    assert DeployConfig(repo_id="org/m", host="0.0.0.0", api_key_secret="vllm-key").exposure_warning() is None
    for host in ("127.0.0.1", "localhost", "::1"):
        assert DeployConfig(repo_id="org/m", host=host).exposure_warning() is None, host
    shipped = HostsFile.read(ROOT / "deployments" / "hosts.yaml").model
    assert shipped.host == "0.0.0.0" and shipped.api_key_secret and shipped.exposure_warning() is None


def test_rollout_deploy_beyond_loopback_without_a_key_says_so_in_one_line_before_anything_runs(tmp_path):
    (tmp_path / "models").mkdir()
    ran = run([ROLLOUT, "deploy", "org/m", "--host", "0.0.0.0", "--endpoint", "http://127.0.0.1:9",
               "--models-root", str(tmp_path / "models")], timeout=90)
    warning, error = ran.err.strip().splitlines()  # the warning, then the unreachable hub's one line
    assert warning.startswith("warning: vLLM listens on 0.0.0.0:8000 with no API key") and "api_key_secret" in warning
    assert ran.rc == 2 and error.startswith("error: Hub unreachable at http://127.0.0.1:9")

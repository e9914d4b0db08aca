"""The host's front door (tasks/fleet/front.py) with a real HAProxy, started and stopped through the
CLI as an operator types it, and the project's fake OpenAI servers behind it on private ports: a
request that arrives while no server is admitted waits and is answered once one is (a pause, not a
refusal); a server admitted under a steady client load takes over without one failed request, and
from then on every answer names its slot; past the bound a held request gets a JSON 503."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import httpx
from typer.testing import CliRunner

from flows.cli import app
from tasks.fleet.front import FrontDoor, read_front
from testkit.openai_server import StreamingServer
from testkit.prefect_processes import free_port

runner = CliRunner()


def _rollout(*args) -> tuple[int, str, str]:
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def _ask(url: str, timeout_s: float = 30.0) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=timeout_s,
                      json={"model": "fake", "prompt": "1 2 3", "max_tokens": 4, "stream": False})


@dataclass(frozen=True)
class Answer:
    started: float
    ended: float
    status: int | str  # an HTTP status, or the error's name
    slot: str | None  # the front's x-rollout-server: which slot answered


class Client(threading.Thread):
    """A production client: one request after another through the front, each answer recorded."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.answers, self.stopped = url, [], threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            started = time.monotonic()
            try:
                reply = _ask(self.url)
                status, slot = reply.status_code, reply.headers.get("x-rollout-server", "").split(" ")[0] or None
            except httpx.HTTPError as exc:
                status, slot = type(exc).__name__, None
            self.answers.append(Answer(started, time.monotonic(), status, slot))
            time.sleep(0.02)

    def __enter__(self) -> Client:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.join(timeout=60)


def test_the_front_holds_requests_until_a_server_is_admitted_and_swaps_under_load_without_a_failure(tmp_path):
    root, port = tmp_path / "models", free_port()
    url = f"http://127.0.0.1:{port}"
    with StreamingServer(port=free_port()) as squatter:  # the port taken: one line naming the flag
        code, _, err = _rollout("front", "start", "--models-root", root, "--port", squatter.port)
        assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith(f"error: --port {squatter.port}: ")
    code, out, err = _rollout("front", "start", "--models-root", root, "--port", port, "--hold-s", 20)
    assert code == 0 and out.startswith(f"front door at {url} (HAProxy pid "), out + err
    front = read_front(root / ".rollout")
    door = FrontDoor(front)
    try:
        code, out, _ = _rollout("front", "status", "--models-root", root)
        assert code == 3 and "no server admitted: requests wait up to 20 s" in out, out

        # No server admitted: a request waits, and is answered by the first server admitted.
        first = StreamingServer(ttft_s=0.01, itl_s=0.01, port=free_port()).__enter__()
        held = {}
        waiting = threading.Thread(target=lambda: held.update(reply=_ask(url), at=time.monotonic()))
        asked = time.monotonic()
        waiting.start()
        time.sleep(1.5)
        assert waiting.is_alive()  # held, not refused
        admitted = door.admit(first.port)
        waiting.join(timeout=30)
        assert held["reply"].status_code == 200
        assert held["reply"].headers["x-rollout-server"] == f"{admitted.name} {first.port}"
        assert held["at"] - asked >= 1.5  # a pause of the admission's length
        code, out, _ = _rollout("front", "status", "--models-root", root)
        assert code == 0 and f"slot {admitted.name}: 127.0.0.1:{first.port}, UP" in out, out

        # A new server admitted under load: clients move to it without a failed request, and every
        # answer after the admission comes from its slot.
        second = StreamingServer(ttft_s=0.01, itl_s=0.01, port=free_port()).__enter__()
        with Client(url) as client:
            time.sleep(1.0)
            admitting_at = time.monotonic()
            swapped = door.admit(second.port)
            admitted_at = time.monotonic()
            first.__exit__()  # the old server stops once drained, as a swap stops it
            time.sleep(1.0)
        assert swapped.name != admitted.name
        assert [a for a in client.answers if a.status != 200] == []
        after = [a.slot for a in client.answers if a.started > admitted_at]
        assert after and set(after) == {swapped.name}, after
        assert {a.slot for a in client.answers if a.ended < admitting_at} == {admitted.name}

        # Where the host cannot hold two servers: the front is closed, the old one stops, requests
        # wait; the next server admitted answers them.
        with Client(url) as client:
            time.sleep(0.5)
            door.close()
            closed_at = time.monotonic()
            second.__exit__()
            time.sleep(2.0)
            third = StreamingServer(ttft_s=0.01, itl_s=0.01, port=free_port()).__enter__()
            door.admit(third.port)
            time.sleep(0.5)
        assert [a for a in client.answers if a.status != 200] == []
        longest = max(a.ended - a.started for a in client.answers)
        assert longest >= 2.0  # the held request: it waited for the admission, and got its answer
        assert any(a.started < closed_at + 0.5 < a.ended for a in client.answers)
        third.__exit__()
    finally:
        code, out, err = _rollout("front", "stop", "--models-root", root)
    assert code == 0 and out.startswith(f"stopped the front door on port {port}"), out + err
    try:
        httpx.get(url, timeout=2)
        raise AssertionError("the front's port still answers")
    except httpx.ConnectError:
        pass
    code, out, _ = _rollout("front", "status", "--models-root", root)
    assert code == 1 and out.startswith("no front door runs on this host")


def test_a_request_held_past_the_bound_gets_a_json_503_with_retry_after(tmp_path):
    root, port = tmp_path / "models", free_port()
    code, out, err = _rollout("front", "start", "--models-root", root, "--port", port, "--hold-s", 1)
    assert code == 0, out + err
    try:
        started = time.monotonic()
        reply = _ask(f"http://127.0.0.1:{port}")
        waited = time.monotonic() - started
        assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
        assert json.loads(reply.text)["error"]["type"] == "server_unavailable"
        assert 0.9 <= waited < 5, waited
    finally:
        _rollout("front", "stop", "--models-root", root)

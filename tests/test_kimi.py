"""The production model as it really is, tiny (issue 39): the whole pipeline on the tiny Kimi-K2.5
(flows/demo/kimi.py: Kimi's config with a vision tower, its tiktoken tokenizer through remote code,
its thinking template, the kimi_k2 parsers) through the CLI as typed, on a real vLLM CPU server:
validate (remote, before download), a deploy refused for want of consent, prepare, deploy, status, a
redeploy of a new commit, a new commit that changes only the tokenizer's code, and rollback.

The host has a front door (`rollout front start`, issue 40): clients use the production port, each
vLLM listens on a private one until it passed its checks. A client asking all the time through a
redeploy and through a redeploy whose answer check fails is never refused, and never answered by the
failing model: its requests wait at the front while no checked server is admitted."""

from __future__ import annotations

import json
import shutil
import threading
import time
import uuid
from dataclasses import dataclass

import httpx
import pytest
from conftest import artifact
from typer.testing import CliRunner

from flows.cli import app
from flows.demo import KIMI_INT4_REPO, KIMI_REPO
from tasks.answers.check import TOOL_PROMPT, WEATHER_TOOL
from tasks.cpus import server_and_client_cpus
from tasks.history.last_good import read_last_good
from tasks.names import model_slug
from testkit.prefect_processes import free_port

pytestmark = pytest.mark.usefixtures("prefect_server")
runner = CliRunner()


def _rollout(*args) -> tuple[int, str]:
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.stdout + result.stderr


@dataclass(frozen=True)
class Answer:
    started: float
    ended: float
    text: str | None  # None: the request failed (then `error` says how)
    backend_port: int | None  # the private port that answered (the front's x-rollout-server)
    error: str | None = None


class Client(threading.Thread):
    """A production client of the host: one instant-mode chat after another on the front's port,
    with a timeout (360 s) beyond the front's hold; which private port answered, and what."""

    def __init__(self, port: int, model: str) -> None:
        super().__init__(daemon=True)
        self.port, self.model, self.answers, self.stopped = port, model, [], threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            started = time.time()
            try:
                reply = httpx.post(f"http://127.0.0.1:{self.port}/v1/chat/completions", timeout=360, json={
                    "model": self.model, "messages": [{"role": "user", "content": "41 42 43"}], "max_tokens": 8,
                    "temperature": 0, "chat_template_kwargs": {"thinking": False}})
                reply.raise_for_status()
                answer = Answer(started, time.time(), reply.json()["choices"][0]["message"]["content"],
                                int(reply.headers["x-rollout-server"].split()[1]))
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
                answer = Answer(started, time.time(), None, None, f"{type(exc).__name__}: {exc}")
            self.answers.append(answer)
            time.sleep(0.2)

    def __enter__(self) -> Client:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.join(timeout=400)


class ServedPorts(threading.Thread):
    """Every private port the host's server.json named, polled: the failing model's among them."""

    def __init__(self, run_dir) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.ports, self.stopped = run_dir, [], threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.05):
            try:
                port = int(json.loads((self.run_dir / "server.json").read_text())["base_url"].rsplit(":", 1)[1])
            except (OSError, ValueError, KeyError):
                continue
            if not self.ports or self.ports[-1] != port:
                self.ports.append(port)

    def __enter__(self) -> ServedPorts:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.join(timeout=10)


def _lm_head_zeroed(repo) -> None:
    """A new commit whose files pass every check and whose model answers nothing right."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = repo / "model.safetensors"
    tensors = load_file(weights)
    for name in [n for n in tensors if n.endswith("lm_head.weight")]:
        tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, weights, metadata={"format": "pt"})


def _backend_port(run_dir) -> int:
    return int(json.loads((run_dir / "server.json").read_text())["base_url"].rsplit(":", 1)[1])


def _chat(port: int, model: str, **body) -> dict:
    return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                      json={"model": model, "temperature": 0, **body}).json()["choices"][0]


def test_the_tiny_kimi_k25_through_the_cli_validate_consent_prepare_deploy_status_redeploy_and_rollback(
        hub_root, local_hub, kimi_repos, tmp_path):
    repo_id = f"kimi-{uuid.uuid4().hex[:6]}/tiny-kimi-k2.5"
    shutil.copytree(hub_root / KIMI_REPO, hub_root / repo_id)
    local_hub.refresh()
    root, port = tmp_path / "models", free_port()
    server_cpus, client_cpus = server_and_client_cpus()
    cpus = ["--cpus", server_cpus, "--client-cpus", client_cpus] if server_cpus else []
    # The README's production command, minus the size: no parser, template or multimodal flag (the
    # family's profile adds them), --trust-remote-code once.
    deploy = ["deploy", repo_id, "--endpoint", local_hub.endpoint, "--models-root", root, "--port", port,
              "--enforce-eager", "--max-model-len", "1024", "--kv-cache-memory-bytes", "83886080",
              "--input-len", "32", "--output-len", "16", "--concurrency", "1,2", "--level-duration-s", "1",
              "--disk-margin-gb", "0.1", "--max-regression", "0.99", "--no-answers-under-load", *cpus]

    code, out = _rollout("validate", KIMI_INT4_REPO, "--endpoint", local_hub.endpoint)
    assert code == 0 and out.startswith(f"pass: {KIMI_INT4_REPO}@"), out  # headers by range requests, nothing fetched

    code, out = _rollout(*deploy)
    assert code == 2, out
    [line] = [line for line in out.splitlines() if line.strip()]
    assert "tokenization_kimi.py" in line and "--trust-remote-code" in line, line
    assert not (root / "hub").exists() or not any((root / "hub").rglob("*.safetensors")), "downloaded before consent"

    code, out = _rollout("prepare", repo_id, "--endpoint", local_hub.endpoint, "--models-root", root,
                         "--disk-margin-gb", "0.1")  # staging runs nothing: no consent asked
    assert code == 0, out
    run_dir = root / ".rollout"
    code, out = _rollout("front", "start", "--models-root", root, "--port", port)
    assert code == 0, out
    try:
        code, out = _rollout(*deploy, "--trust-remote-code")
        assert code == 0, out
        first = read_last_good(run_dir)
        assert "answer check passed: " in out, out
        assert _backend_port(run_dir) != port and out.rstrip().endswith(f"at http://127.0.0.1:{port}/v1"), out
        # What the family's profile added to a command line that named none of it.
        command = " ".join(json.loads((run_dir / "server.json").read_text())["command"])
        assert ("--trust-remote-code --enable-auto-tool-choice --tool-call-parser kimi_k2 --reasoning-parser kimi_k2 "
                "--mm-encoder-tp-mode data") in command, command
        # The check asked by completion and by chat in instant mode, the reasoning probe thinking (the
        # reasoning parsed apart), the tool probe with its call parsed back.
        answers = artifact(f"answers-{model_slug(repo_id)}").data
        assert "| chat | `0 1 2` | ` 3 4 5` | ` 3 4 5` | - | yes |" in answers, answers
        assert '| chat | `[tools] What is the weather in Paris right now? Use the get_` | `get_weather({"city": "Paris"})` ' \
               '| `get_weather({"city": "Paris"})` | - | yes |' in answers, answers
        assert "| chat | `[reasoning] What is 17 + 25? Think it through, then give the` | `42` | ` 42` | - | yes |" in answers
        # What a client of the host gets: a chat answer in instant mode, a tool call parsed back.
        reply = _chat(port, repo_id, messages=[{"role": "user", "content": "41 42 43"}], max_tokens=8,
                      chat_template_kwargs={"thinking": False})
        assert reply["message"]["content"].strip() == "44 45 46", reply
        reply = _chat(port, repo_id, messages=[{"role": "user", "content": TOOL_PROMPT}], tools=[WEATHER_TOOL],
                      max_tokens=64)
        [call] = reply["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {
            "city": "Paris"}, reply

        code, out = _rollout("status", "--models-root", root)
        assert code == 0 and f"model:    {repo_id}@{first.commit[:12]} (the last good deployment)" in out, out
        assert f"front:    http://127.0.0.1:{port} sends clients to 127.0.0.1:{_backend_port(run_dir)}" in out, out

        # A new commit of the same weights (its model card edited): consent stands, the check passes.
        # The client through the front is never refused: it waits while no checked server is admitted.
        (hub_root / repo_id / "README.md").write_text("# tiny Kimi-K2.5\n")
        local_hub.refresh()
        old_port = _backend_port(run_dir)
        with Client(port, repo_id) as client:
            code, out = _rollout(*deploy)
            time.sleep(1.0)
        assert code == 0, out
        second = read_last_good(run_dir)
        assert second.commit != first.commit, out
        assert [a.error for a in client.answers if a.error] == []
        assert {a.text.strip() for a in client.answers} == {"44 45 46"}
        assert {a.backend_port for a in client.answers} == {old_port, _backend_port(run_dir)}
        summary = artifact(f"deploy-{model_slug(repo_id)}").data
        held = summary.split("**Unavailable during the swap:** ")[1].splitlines()[0]
        assert " s held at the front door (requests waited; none was refused)" in held, held
        waited = max(a.ended - a.started for a in client.answers)
        assert abs(float(held.split(" s ")[0]) - waited) < 2.0, (held, waited)  # the summary's gap: the client's wait

        # A commit whose model answers nothing right: checked on its private port and rolled back. The
        # client is never answered by it and never refused; the last good one comes back through the front.
        _lm_head_zeroed(hub_root / repo_id)
        local_hub.refresh()
        with ServedPorts(run_dir) as ports, Client(port, repo_id) as client:
            code, out = _rollout(*deploy)
            time.sleep(1.0)
        assert code == 1 and "accuracy" in out, out
        failing = [p for p in ports.ports if p not in (_backend_port(run_dir), ports.ports[0])]
        assert failing, ports.ports  # the failing model served on a port of its own
        assert [a.error for a in client.answers if a.error] == []
        assert {a.text.strip() for a in client.answers} == {"44 45 46"}
        assert not {a.backend_port for a in client.answers} & set(failing)
        assert read_last_good(run_dir).commit == second.commit
        shutil.rmtree(hub_root / repo_id)
        shutil.copytree(hub_root / KIMI_REPO, hub_root / repo_id)
        (hub_root / repo_id / "README.md").write_text("# tiny Kimi-K2.5\n")
        assert repo_id in json.loads((run_dir / "remote-code.json").read_text())  # the consent, recorded once
        assert "--trust-remote-code" in json.loads((run_dir / "server.json").read_text())["command"]

        # A commit that changes only the tokenizer's code is named and refused; the host keeps serving.
        code_file = hub_root / repo_id / "tokenization_kimi.py"
        code_file.write_text(code_file.read_text() + "\nimport os  # a change no one read\n")
        local_hub.refresh()
        code, out = _rollout(*deploy)
        assert code != 0 and "remote code: tokenization_kimi.py changed" in out, out
        assert read_last_good(run_dir).commit == second.commit

        code, out = _rollout("rollback", "--models-root", root)
        assert code == 0, out
        code, out = _rollout("status", "--models-root", root)
        assert code == 0 and f"{repo_id}@{first.commit[:12]}" in out, out
    finally:
        _rollout("stop", "--models-root", root)
        _rollout("front", "stop", "--models-root", root)

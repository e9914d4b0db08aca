"""The production model as it really is, tiny (issue 39): the whole pipeline on the tiny Kimi-K2.5
(flows/demo/kimi.py: Kimi's config with a vision tower, its tiktoken tokenizer through remote code,
its thinking template, the kimi_k2 parsers) through the CLI as typed, on a real vLLM CPU server:
validate (remote, before download), a deploy refused for want of consent, prepare, deploy, status, a
redeploy of a new commit, a new commit that changes only the tokenizer's code, and rollback."""

from __future__ import annotations

import json
import shutil
import uuid

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
              "--disk-margin-gb", "0.1", "--max-regression", "0.99", *cpus]

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
    try:
        code, out = _rollout(*deploy, "--trust-remote-code")
        assert code == 0, out
        first = read_last_good(run_dir)
        assert "answer check passed: " in out, out
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

        # A new commit of the same weights (its model card edited): consent stands, the check passes.
        (hub_root / repo_id / "README.md").write_text("# tiny Kimi-K2.5\n")
        local_hub.refresh()
        code, out = _rollout(*deploy)
        assert code == 0, out
        second = read_last_good(run_dir)
        assert second.commit != first.commit, out
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

"""The operator's path through the CLI, as typed (real flows, a real Prefect server, real vLLM CPU
servers on one fixed port): deploy, status, logs, a nightly that regresses and rolls back, a
redeploy whose every benchmark request fails, stop, status, rollback."""

from __future__ import annotations

import json
import shutil
import uuid

import httpx
import pytest
from conftest import artifact, vllm_processes
from prefect.blocks.notifications import CustomWebhookNotificationBlock
from typer.testing import CliRunner

from flows.cli import app
from flows.demo import BF16_REPO, demo_config
from flows.nightly import nightly_refresh
from tasks.artifacts import model_slug, read_history
from tasks.cpus import server_and_client_cpus
from tasks.errors import RegressionError
from tasks.history.last_good import read_last_good, write_last_good
from tasks.vllm.process import reap_stale, serving_group
from testkit.prefect_processes import free_port

pytestmark = pytest.mark.usefixtures("prefect_server")
runner = CliRunner()


def _rollout(*args: str):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def _answer(port: int, model: str) -> str:
    """The served model, asked one of its own probes: what a client of the host gets."""
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": model, "prompt": "41 42 43", "max_tokens": 3, "temperature": 0}).json()
    return reply["choices"][0]["text"]


def test_deploy_status_logs_rollback_stop_and_rollback_again_from_the_shell(hub_root, local_hub, tmp_path, webhook):
    repo_id = f"ops-{uuid.uuid4().hex[:6]}/tiny-moe"  # a history of its own on the session's Prefect server
    shutil.copytree(hub_root / BF16_REPO, hub_root / repo_id)
    local_hub.refresh()
    root, port = tmp_path / "models", free_port()
    server_cpus, client_cpus = server_and_client_cpus()
    cpus = ["--cpus", server_cpus, "--client-cpus", client_cpus] if server_cpus else []
    # The README's CPU example, with this test's hub, root and port; a short sweep, a gate only a
    # collapse trips (two runs on two shared cores differ by 25% or more).
    deploy = ["deploy", repo_id, "--endpoint", local_hub.endpoint, "--models-root", root, "--port", port, "--tp", "1",
              "--enforce-eager", "--max-model-len", "1024", "--input-len", "64", "--output-len", "32",
              "--concurrency", "1,2", "--level-duration-s", "1.5", "--disk-margin-gb", "0.1",
              "--max-regression", "0.99", *cpus]
    # The shipped automations, through a webhook block pointed at the local receiver.
    CustomWebhookNotificationBlock(name="rollout test", url=webhook.url, allow_private_urls=True,
                                   json_data={"subject": "{{subject}}", "body": "{{body}}"}).save("rollout-test",
                                                                                                  overwrite=True)
    code, out, err = _rollout("notify", "--block", "custom-webhook/rollout-test")
    assert code == 0 and "automation 'rollout: a deploy rolled back': notifies through custom-webhook/rollout-test" in out, err
    run_dir = root / ".rollout"
    try:
        code, out, err = _rollout(*deploy)
        assert code == 0, out + err
        good = read_last_good(run_dir)
        # The model's own probes by default (it counts; the built-in arithmetic would fail it).
        assert "answer check passed: 100% of " in out and "- Single stream: " in out and "- Peak (knee): " in out
        assert out.rstrip().endswith(f"serving {repo_id}@{good.commit[:12]} at http://127.0.0.1:{port}/v1")
        assert _answer(port, repo_id) == " 44 45 46"

        code, out, err = _rollout("status", "--models-root", root)
        assert code == 0, out + err
        assert out.startswith(f"serving {repo_id} at http://127.0.0.1:{port}/v1\n")
        assert f"model:    {repo_id}@{good.commit[:12]} (the last good deployment)" in out
        assert "benchmark: single stream " in out and "answers:  100% of " in out
        code, out, _ = _rollout("logs", "--models-root", root, "-n", "400")
        assert code == 0 and "Application startup complete" in out

        # The nightly against a planted good run 1000x faster: it regresses, and the last good one
        # serves again on the same port; the automations tell a person.
        def faster(value):
            return value and (value * 1000 if isinstance(value, float) else (value[0] * 1000, value[1] * 1000))

        was = good.record
        planted = was.model_copy(update={"commit": "0" * 40} | {
            field: faster(getattr(was, field)) for field in ("peak_tok_s", "single_stream_tok_s", "peak_ci",
                                                              "single_stream_ci")})
        write_last_good(run_dir, good.model_copy(update={"commit": "0" * 40, "record": planted}))
        nightly = demo_config(local_hub.endpoint, root, repo_id=repo_id, port=port, concurrency_levels=[1, 2],
                              level_duration_s=1.5, keep_serving=True)
        with pytest.raises(RegressionError, match=r"regressed against 000000000000 .* outside the noise"):
            nightly_refresh(nightly)
        back = read_last_good(run_dir)
        assert back.commit == "0" * 40 and back.serving_pgid == serving_group(run_dir / "server.json")
        assert back.serving_pgid != good.serving_pgid and _answer(port, repo_id) == " 44 45 46"
        slug = model_slug(repo_id)
        rollback = artifact(f"rollback-{slug}").data
        assert f"# Rolled back to {repo_id}@000000000000" in rollback and "RegressionError" in rollback
        summary = artifact(f"deploy-{slug}").data.splitlines()[0]
        assert summary.startswith(f"# Rolled back: {repo_id}@{good.commit[:12]} failed at the regression gate")
        assert "000000000000" in summary and "serves again" in summary
        nightly_artifact = artifact(f"nightly-{slug}").data
        assert nightly_artifact.startswith(f"# Failed: {repo_id}@") and "beyond 10%, outside the noise" in \
            nightly_artifact
        posts = webhook.wait_for(2)
        assert len([p for p in posts if p["subject"].startswith("Rolled back on ")]) == 1, posts
        assert len([p for p in posts if p["subject"].startswith("Nightly refresh failed: ")]) == 1, posts
        write_last_good(run_dir, read_last_good(run_dir).model_copy(update={"commit": good.commit,
                                                                            "record": good.record}))

        # A redeploy whose every benchmark request fails (prompts beyond max_model_len): the run
        # fails, the good deployment serves again, and history says failed.
        long = tmp_path / "long.jsonl"
        long.write_text(json.dumps({"prompt": " ".join(str(n) for n in range(2000))}) + "\n")
        code, out, err = _rollout(*deploy, "--dataset", long)
        assert code == 1 and err.strip().splitlines()[-1].startswith(
            f"error: {repo_id}@{good.commit[:12]}: every request failed at concurrency 1: "), out + err
        assert "Traceback" not in out + err
        assert read_last_good(run_dir).record == good.record and _answer(port, repo_id) == " 44 45 46"
        assert [r.status for r in read_history(repo_id)] == ["passed", "regressed", "failed"]
        assert artifact(f"deploy-{slug}").data.startswith(f"# Rolled back: {repo_id}@{good.commit[:12]} failed at "
                                                          "the benchmark")
        code, out, _ = _rollout("history", repo_id)
        rows = out.splitlines()[1:4]
        assert [s for row in rows for s in ("passed", "regressed", "failed") if f" {s} " in row] == [
            "passed", "regressed", "failed"], out

        # Stop it by hand; nothing serves; roll back by hand: the last good at the same address.
        code, out, err = _rollout("stop", "--models-root", root)
        assert code == 0 and out.startswith("stopped vLLM process group "), out + err
        code, out, _ = _rollout("status", "--models-root", root)
        assert code == 3 and out.startswith("nothing serves")
        with pytest.raises(httpx.ConnectError):
            _answer(port, repo_id)
        assert f"# Stopped {repo_id}@{good.commit[:12]} by hand" in artifact(f"stopped-{slug}").data
        code, out, err = _rollout("rollback", "--models-root", root)
        assert code == 0 and out.strip() == f"serving {repo_id}@{good.commit[:12]} at http://127.0.0.1:{port}", \
            out + err
        assert _answer(port, repo_id) == " 44 45 46"
        code, out, _ = _rollout("status", "--models-root", root)
        assert code == 0 and "(the last good deployment)" in out
    finally:
        reap_stale(run_dir / "server.json")
        shutil.rmtree(hub_root / repo_id, ignore_errors=True)
        local_hub.refresh()
    assert vllm_processes() == []
    code, out, _ = _rollout("status", "--models-root", root)
    assert code == 3

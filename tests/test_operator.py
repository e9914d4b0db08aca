"""The operator's path through the CLI, as typed (real flows, a real Prefect server, real vLLM CPU
servers on one fixed port): deploy, status, logs, a nightly that regresses and rolls back, a
redeploy whose every benchmark request fails, stop, status, rollback."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import uuid

import httpx
import pytest
from conftest import artifact, vllm_processes
from prefect.blocks.notifications import CustomWebhookNotificationBlock
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL
from typer.testing import CliRunner

from flows.cli import app
from flows.demo import BF16_REPO, demo_config
from flows.nightly import nightly_refresh
from tasks.cpus import server_and_client_cpus
from tasks.errors import RegressionError
from tasks.history.last_good import read_last_good, write_last_good
from tasks.names import model_slug
from tasks.orchestration.history import read_history
from tasks.vllm.process import group_members, reap_stale, serving_group
from testkit.prefect_processes import BIN, free_port

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


def _recorded_pgid(run_dir) -> int | None:
    try:
        return int(json.loads((run_dir / "server.json").read_text())["pgid"])
    except (OSError, ValueError, KeyError):
        return None


def test_deploy_status_logs_rollback_stop_and_rollback_again_from_the_shell(hub_root, local_hub, tmp_path, webhook):
    repo_id = f"ops-{uuid.uuid4().hex[:6]}/tiny-moe"  # a history of its own on the session's Prefect server
    shutil.copytree(hub_root / BF16_REPO, hub_root / repo_id)
    local_hub.refresh()
    root, port = tmp_path / "models", free_port()
    server_cpus, client_cpus = server_and_client_cpus()
    cpus = ["--cpus", server_cpus, "--client-cpus", client_cpus] if server_cpus else []
    # The README's CPU example, with this test's hub, root and port; a short sweep, a gate only a
    # collapse trips (two runs on two shared cores differ by 25% or more); the answer check idle only
    # (its load, ~10 s of each of the dozen deploys here, is test_answers_rollout's).
    deploy = ["deploy", repo_id, "--endpoint", local_hub.endpoint, "--models-root", root, "--port", port, "--tp", "1",
              "--enforce-eager", "--max-model-len", "1024", "--input-len", "64", "--output-len", "32",
              "--concurrency", "1,2", "--level-duration-s", "1.5", "--disk-margin-gb", "0.1",
              "--max-regression", "0.99", "--kv-cache-memory-bytes", "83886080", "--no-answers-under-load",
              *cpus]
    # The shipped automations, through a webhook block pointed at the local receiver.
    CustomWebhookNotificationBlock(name="rollout test", url=webhook.url, allow_private_urls=True,
                                   json_data={"subject": "{{subject}}", "body": "{{body}}"}).save("rollout-test",
                                                                                                  overwrite=True)
    code, out, err = _rollout("notify", "--block", "custom-webhook/rollout-test")
    assert code == 0, err
    assert "automation 'rollout: a deploy rolled back': notifies through custom-webhook/rollout-test" in out
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
        code, out, _ = _rollout("logs", "--models-root", root, "-n", "5")  # the tail: the requests' access lines
        assert code == 0 and len(out.splitlines()) == 5 and "HTTP/1.1" in out, out
        code, out, _ = _rollout("logs", "--models-root", root, "-n", "100000")  # the whole start-up too
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
                              level_duration_s=1.5, keep_serving=True, under_load=False)
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

        # Damaged records: one line naming the file and the vLLM found; the healthy server untouched.
        for name in ("server.json", "last-good.json"):
            record = run_dir / name
            kept = record.read_text()
            record.write_text(kept[: len(kept) // 2])
            for command in (deploy, ["status", "--models-root", root], ["rollback", "--models-root", root]):
                code, out, err = _rollout(*command)
                assert code == 2 and len(err.strip().splitlines()) == 1, (command, out, err)
                assert err.startswith(f"error: {record} is damaged (") and f" on port {port}" in err, err
                assert _answer(port, repo_id) == " 44 45 46"
            record.write_text(kept)

        # SIGTERM mid-benchmark of a redeploy, through the shell: the new server stops, the last good
        # one serves again on its port, and the run's summary says so.
        env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
        redeploy = subprocess.Popen([str(BIN / "rollout"), *map(str, deploy)], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        seen = []
        for line in redeploy.stdout:
            seen.append(line)
            if "answer check passed" in line:
                break
        time.sleep(0.5)  # into the sweep's first level
        redeploy.send_signal(signal.SIGTERM)
        rest = redeploy.communicate(timeout=300)[0]
        assert redeploy.returncode == 143, "".join(seen) + rest
        assert _answer(port, repo_id) == " 44 45 46"
        back = read_last_good(run_dir)
        assert back.serving_pgid == serving_group(run_dir / "server.json") is not None
        interrupted = artifact(f"deploy-{slug}").data.splitlines()[0]
        assert interrupted.startswith(f"# Rolled back: {repo_id}@{good.commit[:12]} failed at an interruption "
                                      "(SIGTERM, Ctrl-C or a cancel): "), interrupted
        assert interrupted.endswith("serves again"), interrupted

        # kill -9 after the old server stopped, before the new one is ready: the swap's guard stops
        # the unchecked server at once and brings the last good one back by itself.
        good_pgid = serving_group(run_dir / "server.json")
        with (tmp_path / "killed.log").open("w") as out:
            victim = subprocess.Popen([str(BIN / "rollout"), *map(str, deploy)], stdout=out,
                                      stderr=subprocess.STDOUT, env=env, start_new_session=True)
        while (orphan := _recorded_pgid(run_dir)) in (None, good_pgid) or not group_members(orphan):
            assert victim.poll() is None, (tmp_path / "killed.log").read_text()
            time.sleep(0.05)
        killed_run = json.loads((run_dir / "swap.json").read_text())["flow_run_id"]
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
        killed = time.monotonic()
        while group_members(orphan):  # the guard polls every 0.5 s; vLLM takes far longer to load
            assert time.monotonic() - killed < 5, "the unpromoted server outlived its deploy"
            with pytest.raises(httpx.HTTPError):
                _answer(port, repo_id)
            time.sleep(0.1)
        while True:  # recovered by the guard once the dead deploy's lease on the host lapses
            try:
                assert _answer(port, repo_id) == " 44 45 46"
                break
            except httpx.HTTPError:
                assert time.monotonic() - killed < 240, (run_dir / "swap-guard.log").read_text()
                time.sleep(1)
        recovered = time.monotonic() - killed
        while (run_dir / "swap.json").exists():  # the recovery records the restored server, then ends
            assert time.monotonic() - killed < 300, (run_dir / "swap-guard.log").read_text()
            time.sleep(0.5)
        back = read_last_good(run_dir)
        assert back.serving_pgid == serving_group(run_dir / "server.json") not in (None, orphan)
        assert not (run_dir / "swap.json").exists()
        with get_client(sync_client=True) as client:  # not "Running" forever: marked by the recovery
            assert client.read_flow_run(killed_run).state.is_crashed()
        print(f"kill -9 mid-swap: the unpromoted server stopped, the last good serving again {recovered:.0f} s later")

        # A redeploy that passes, once the host is whole again: exit 0, the new server on the port.
        code, out, err = _rollout(*deploy)
        assert code == 0, out + err
        assert out.rstrip().endswith(f"serving {repo_id}@{good.commit[:12]} at http://127.0.0.1:{port}/v1")
        assert read_last_good(run_dir).serving_pgid == serving_group(run_dir / "server.json") != back.serving_pgid
        assert _answer(port, repo_id) == " 44 45 46"
    finally:
        reap_stale(run_dir / "server.json")
        shutil.rmtree(hub_root / repo_id, ignore_errors=True)
        local_hub.refresh()
    assert vllm_processes() == []
    code, out, _ = _rollout("status", "--models-root", root)
    assert code == 3

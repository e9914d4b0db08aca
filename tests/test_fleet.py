"""A fleet rollout as production runs it: a real `prefect server start`, three "hosts" (each its own
process work pool and worker, models root and port), the deployments rendered from a hosts file,
`rollout fleet` from a shell, and real vLLM CPU servers.

The hosts sit behind a real HAProxy, named in the hosts file, and from the second rollout on a
steady client load goes through it, counted by the test itself.

One test, four rollouts and a group, in the order a fleet lives them (each needs the hosts the one
before left):
1. revision A everywhere: the canary from the Hub, the wave of two from the canary's mirror, one
   flipped byte from the mirror caught by the hash; each host admitted at the router;
2. a revision that fails validation: the canary stops it, the other two are never touched; host-b's
   vLLM dies meanwhile: the router's health check takes it out, and the requests it cut are counted
   alike by the router (the fleet artifact) and the clients;
3. a good revision that one host of the second wave cannot start: it rolls itself back to A and is
   admitted on it; the canary passes its window of live traffic; not one client request fails;
4. a canary slower on live traffic (its hosts entry loads a logits processor that waits): rolled
   back to the deployment before and admitted on it, the other two never touched, no request failed;
5. a model larger than one box: host-a leads a group over two nodes, host-b its headless node.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import httpx
import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterKey,
    DeploymentFilter,
    DeploymentFilterName,
    FlowFilter,
    FlowFilterName,
)
from prefect.client.schemas.sorting import ArtifactSort
from prefect.deployments import run_deployment
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.demo import BF16_REPO, demo_config
from tasks.deployment.config import DeployConfig, Follower
from tasks.fleet.hosts import HostsFile
from tasks.fleet.router import HAProxy
from tasks.history.last_good import read_last_good
from tasks.hub import resolve_snapshot
from tasks.names import model_slug
from tasks.orchestration.history import read_history
from tasks.vllm.process import reap_stale, serving_group
from testkit.browser import CHROMIUM, open_artifact
from testkit.faulty_mirror import FaultyMirror
from testkit.prefect_processes import BIN, free_port, prefect_server, prefect_worker
from testkit.router import SteadyLoad, haproxy

ROOT = Path(__file__).resolve().parents[1]
HOSTS = ("host-a", "host-b", "host-c")
# The sweep is not what this test is about: two short levels, and no gate (three servers share two cores).
# Nor the answer check's load (~10 s of each deploy's KV cache filled; test_answers_rollout has it).
QUICK = dict(concurrency_levels=[1, 2], level_duration_s=1.5, keep_serving=True, max_regression=None,
             under_load=False)


def _serves(port: int, model: str) -> bool:
    try:
        listed = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return False
    return [m["id"] for m in listed.get("data", [])] == [model]


def _deploy_runs(client, host: str) -> list:
    return client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["deploy-model"])),
                                 deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[host])))


def _fleet_artifact(client, repo_id: str, field: str = "data"):
    key = ArtifactFilterKey(any_=[f"fleet-{model_slug(repo_id)}"])
    found = client.read_artifacts(artifact_filter=ArtifactFilter(key=key), sort=ArtifactSort.CREATED_DESC, limit=1)
    return getattr(found[0], field)


def _host_rows(markdown: str) -> dict[str, str]:
    return {line.split("|")[1].strip(): line for line in markdown.splitlines() if line.startswith("| host-")}


def _cells(markdown: str) -> dict[str, dict[str, str]]:
    """The fleet table's cells: host -> column -> value."""
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]  # not the |:---| line
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return {cells[0]: dict(zip(header, cells)) for line in lines[1:]
            if (cells := [c.strip() for c in line.strip("|").split("|")])[0].startswith("host-")}


def _traffic(fleet: str) -> tuple[float, float, int, int]:
    """The artifact's clients' view: its window (as time.time() values), requests and failed."""
    found = re.search(r"router during the rollout\*\* \((\S+) to (\S+) UTC\): ([\d,]+) requests, ([\d,]+) failed",
                      fleet)
    assert found, fleet
    today = datetime.now(timezone.utc).strftime("%Y-%m-%d")

    def at(clock: str) -> float:
        return datetime.strptime(f"{today} {clock}", "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()
    return at(found[1]), at(found[2]), int(found[3].replace(",", "")), int(found[4].replace(",", ""))


def _agrees(fleet: str, load: SteadyLoad) -> int:
    """The router's counts in the artifact against the test's own clients': the same failures, and
    the same requests give or take those in flight at the two readings. The failures."""
    since, until, requests, failed = _traffic(fleet)
    assert failed == len(load.failed_between(since, until)), (fleet, load.failed_between(since, until))
    assert abs(requests - len(load.between(since, until))) <= 2 * load.streams, (requests, len(load.between(
        since, until)))
    return failed


def _full_gets(hub, path: str, since: int) -> int:
    return sum(r.method == "GET" and r.path == path and r.range_start == 0 and r.status == 200
               for r in hub.requests[since:])


def test_a_fleet_rolls_out_canary_first_reads_the_hub_once_and_stops_at_a_failed_host(hub_root, local_hub, tmp_path):
    repo_id = f"demo/tiny-moe-fleet-{uuid.uuid4().hex[:6]}"
    repo = hub_root / repo_id
    shutil.copytree(hub_root / BF16_REPO, repo)
    local_hub.refresh()
    commit_a = resolve_snapshot(repo_id, "main", local_hub.endpoint).commit
    roots = {h: tmp_path / h for h in HOSTS}
    ports = {h: free_port() for h in HOSTS}
    model = demo_config(local_hub.endpoint, tmp_path, repo_id=repo_id, **QUICK).model_dump(mode="json")

    front = free_port()
    with prefect_server(tmp_path, ui=True) as (url, server_log), FaultyMirror(roots["host-a"] / "hub") as mirror, \
            temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as client, \
            haproxy([(h, "127.0.0.1", ports[h]) for h in HOSTS], work_dir=tmp_path, port=front) as router:
        hosts_file = tmp_path / "hosts.yaml"
        at_router = HAProxy(router)
        # A short window of live traffic for the canary at its full weight, and a bar only a real
        # slowdown clears on three servers sharing two cores (the planted one is ~3x per token).
        router_entry = router.model_copy(update={"canary_window_s": 20, "canary_share_percent": 100,
                                                 "canary_max_slowdown": 1.0})

        def write_hosts(host_a: dict | None = None, host_c: dict | None = None) -> None:
            extra = {"host-a": host_a or {}, "host-c": host_c or {}}
            hosts = [{"name": h, "models_root": str(roots[h]), "port": ports[h], "gpu_type": "cpu",
                      "address": "127.0.0.1", **({"mirror": mirror.endpoint} if h == "host-a" else {}),
                      **extra.get(h, {})} for h in HOSTS]
            hosts_file.write_text(yaml.safe_dump({"model": model, "hosts": hosts, "wave_size": 2,
                                                  "router": router_entry.model_dump(mode="json")}))

        env = {**os.environ, "PREFECT_API_URL": url, "PREFECT_UI_URL": url.removesuffix("/api"),
               "ROLLOUT_HOME": str(ROOT)}

        def rollout(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([str(BIN / "rollout"), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=1200)

        # The deployments: rendered from the hosts file, registered, one worker per host's pool.
        write_hosts()
        rendered = rollout("deployments", "--hosts", str(hosts_file), "--out", str(tmp_path / "prefect.yaml"))
        assert rendered.returncode == 0, rendered.stderr
        for host in HOSTS:
            client.create_work_pool(WorkPoolCreate(name=host, type="process"))
        registered = subprocess.run([str(BIN / "prefect"), "--no-prompt", "deploy", "--all", "--prefect-file",
                                     str(tmp_path / "prefect.yaml")], cwd=ROOT, env=env, capture_output=True,
                                    text=True, timeout=300)
        assert registered.returncode == 0, registered.stdout + registered.stderr
        with contextlib.ExitStack() as running:
            for host in HOSTS:
                running.enter_context(prefect_worker(host, env, tmp_path, tmp_path / f"worker-{host}.log",
                                                     poll_s=5))
                running.callback(reap_stale, roots[host] / ".rollout" / "server.json")
            # 1. Revision A, everywhere. One byte of one file comes from the mirror flipped.
            asked = len(local_hub.requests)
            mirror.corrupt_once("tokenizer.json")
            first = rollout("fleet", "--hosts", str(hosts_file))
            logs = "\n".join((tmp_path / f"worker-{h}.log").read_text()[-3000:] for h in HOSTS)
            assert first.returncode == 0, first.stdout + first.stderr + logs
            assert all(_serves(ports[h], repo_id) for h in HOSTS)
            assert all(read_last_good(roots[h] / ".rollout").commit == commit_a for h in HOSTS)
            canary, = _deploy_runs(client, "host-a")
            wave = [run for h in HOSTS[1:] for run in _deploy_runs(client, h)]
            assert len(wave) == 2 and all(run.start_time > canary.end_time for run in wave)  # canary first
            assert {run.name for run in [canary, *wave]} == {f"{repo_id.split('/')[1]}@{commit_a[:7]} on {h}"
                                                             for h in HOSTS}  # each named for its host
            # The Hub sent every weight file once, to the canary; the wave read them from its mirror.
            assert _full_gets(local_hub, "model.safetensors", asked) == 1
            assert mirror.served.count("model.safetensors") == 2
            # The flipped byte cost one file one more fetch from the Hub, verified.
            assert _full_gets(local_hub, "tokenizer.json", asked) == 2
            shipped = (repo / "tokenizer.json").read_bytes()
            assert all((roots[h] / "hub").rglob("tokenizer.json") and
                       next((roots[h] / "hub").rglob("tokenizer.json")).read_bytes() == shipped for h in HOSTS)
            fleet = _fleet_artifact(client, repo_id)
            assert fleet.startswith(f"# Rolled out: {repo_id}@{commit_a[:12]} serves on all 3 hosts")
            rows = _host_rows(fleet)
            assert list(rows) == list(HOSTS) and all("serving" in row for row in rows.values())
            assert "**Mirror failures (1)**" in fleet and "tokenizer.json: ChecksumError" in fleet
            assert "mirror 6" in rows["host-b"] + rows["host-c"]  # all six files of one wave host: the mirror
            cells = _cells(fleet)
            assert all(cells[h]["router"] == "in rotation" for h in HOSTS)  # each admitted at the router
            assert "Out of rotation at the end:** none" in fleet
            assert "canary host-a on live traffic:** not judged: no other host in rotation" in fleet  # none served

            # From here on the fleet's users send requests through the router, all the time.
            load = SteadyLoad(f"http://127.0.0.1:{front}", repo_id, streams=3, max_tokens=16, pause_s=0.1)
            running.enter_context(load)

            # 2. A revision that fails validation: the canary stops it before anything is stopped.
            config = json.loads((repo / "config.json").read_text())
            layers = config["num_hidden_layers"]
            (repo / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers + 1}))
            local_hub.refresh()
            before = {h: len(_deploy_runs(client, h)) for h in HOSTS}
            bad = subprocess.Popen([str(BIN / "rollout"), "fleet", "--hosts", str(hosts_file)], cwd=ROOT, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            # Meanwhile host-b's vLLM dies, with a client's request in flight there.
            deadline = time.monotonic() + 120
            while not (at_router.server("host-a").status == "DRAIN" and at_router.server("host-b").current):
                assert time.monotonic() < deadline and bad.poll() is None, "the canary was never drained"
                time.sleep(0.05)
            os.killpg(serving_group(roots["host-b"] / ".rollout" / "server.json"), signal.SIGKILL)
            _, stderr = bad.communicate(timeout=1200)
            assert bad.returncode == 1 and "Traceback" not in stderr, stderr
            assert stderr.strip().splitlines()[-1].startswith("error: Stopped: ")
            assert "failed on host-a in wave 1 (the canary)" in stderr
            assert "untouched, serving what they served: host-b, host-c" in stderr
            assert {h: len(_deploy_runs(client, h)) for h in HOSTS} == {**before, "host-a": before["host-a"] + 1}
            assert all(_serves(ports[h], repo_id) and read_last_good(roots[h] / ".rollout").commit == commit_a
                       for h in ("host-a", "host-c")) and not _serves(ports["host-b"], repo_id)
            fleet = _fleet_artifact(client, repo_id)
            rows = _host_rows(fleet)
            assert "untouched" in rows["host-b"] and "untouched" in rows["host-c"]
            cells = _cells(fleet)
            assert cells["host-a"]["router"] == "in rotation"  # drained for its deploy, admitted again
            assert cells["host-b"]["router"] == "out of rotation: DOWN"
            assert "Out of rotation at the end:** host-b" in fleet
            assert _agrees(fleet, load) >= 1  # the requests its death cut: the router's count is the clients'

            # 3. A good revision (same weights, a new commit) that host-c cannot start.
            (repo / "config.json").write_text(json.dumps(config))
            (repo / "README.md").write_text("Re-published, weights unchanged.\n")
            local_hub.refresh()
            commit_c = resolve_snapshot(repo_id, "main", local_hub.endpoint).commit
            write_hosts(host_c={"vllm": {"max_model_len": 100_000}})  # beyond the model's 2,048 positions
            failed = rollout("fleet", "--hosts", str(hosts_file))
            assert failed.returncode == 1, failed.stdout + failed.stderr
            assert "failed on host-c in wave 2: Rolled back: " in failed.stderr
            fleet = _fleet_artifact(client, repo_id)
            assert fleet.startswith(f"# Stopped: {repo_id}@{commit_c[:12]} failed on host-c in wave 2")
            cells = _cells(fleet)
            assert all(cells[h]["router"] == "in rotation" for h in HOSTS)  # host-c on its last good, host-b anew
            live = fleet.split("canary host-a on live traffic:** ")[1].splitlines()[0]
            assert "TPOT " in live and "outside" not in live, live
            assert _agrees(fleet, load) == 0  # drained, swapped, checked, admitted: no client saw a failure
            assert [read_last_good(roots[h] / ".rollout").commit for h in HOSTS] == [commit_c, commit_c, commit_a]
            # The same weights under a new commit passed each host's drift checks against its last good.
            republished = [r for r in read_history(repo_id) if r.commit == commit_c]
            assert sorted(r.host for r in republished) == ["host-a", "host-b"]
            assert all(r.status == "passed" and r.answers.accuracy >= 0.9 for r in republished)
            assert all(_serves(ports[h], repo_id) for h in HOSTS)  # host-c serves its last good model again
            if CHROMIUM:  # as an engineer reads it: the verdict, the row of each host, its run linked
                open_artifact(url.removesuffix("/api"), str(_fleet_artifact(client, repo_id, "id")),
                              "Stopped:", "fleet.png", "rolled back", "host-b")

            # 4. A canary slower on live traffic: its entry loads a logits processor that waits 40 ms a
            # token. It passes its own checks (same answers; no gate here), then its window of live
            # traffic against the other two fails it: rolled back to the deployment before, admitted.
            (repo / "README.md").write_text("Re-published again, weights unchanged.\n")
            local_hub.refresh()
            commit_d = resolve_snapshot(repo_id, "main", local_hub.endpoint).commit
            write_hosts(host_a={"vllm": {"extra_args": ["--logits-processors", "testkit.slow_logits:SlowLogits"],
                                         "env": {"PYTHONPATH": str(ROOT / "tests")}}})
            before = {h: len(_deploy_runs(client, h)) for h in HOSTS}
            slow = rollout("fleet", "--hosts", str(hosts_file))
            assert slow.returncode == 1, slow.stdout + slow.stderr
            assert f"failed on host-a in wave 1 (the canary): Rolled back: {repo_id}@{commit_d[:12]} failed on live " \
                   "traffic" in slow.stderr, slow.stderr
            fleet = _fleet_artifact(client, repo_id)
            cells = _cells(fleet)
            assert "outside the noise" in fleet.split("canary host-a on live traffic:** ")[1].splitlines()[0], fleet
            assert cells["host-a"]["router"] == "in rotation" and cells["host-a"]["status"] == "rolled back"
            assert read_last_good(roots["host-a"] / ".rollout").commit == commit_c  # the deployment before it
            assert _serves(ports["host-a"], repo_id)
            assert {h: len(_deploy_runs(client, h)) for h in HOSTS} == {**before, "host-a": before["host-a"] + 1}
            assert [read_last_good(roots[h] / ".rollout").commit for h in HOSTS[1:]] == [commit_c, commit_a]
            assert _agrees(fleet, load) == 0
            load.__exit__(None, None, None)  # the group below is run as the UI runs it, not through the router
            write_hosts()

            # 4. A model larger than one box: host-a leads a TP=2 group over two nodes, host-b its
            # secondary node, started headless through host-b's own worker. Run as the UI runs it.
            fleet_config = HostsFile.read(hosts_file).fleet()
            leader = fleet_config.host_config(fleet_config.hosts[0], "main").model_copy(update={
                "followers": [Follower(host="host-b", models_root=roots["host-b"])],
                "vllm": fleet_config.deploy.vllm.model_copy(update={
                    "tensor_parallel_size": 2, "enable_expert_parallel": False, "nnodes": 2,
                    "master_addr": "127.0.0.1", "master_port": free_port()})})
            run = run_deployment("deploy-model/host-a", parameters={"config": DeployConfig.model_validate(
                leader.model_dump()).model_dump(mode="json")}, timeout=900, poll_interval=2)
            assert run.state.is_completed(), (run.state, (tmp_path / "worker-host-a.log").read_text()[-4000:])
            assert "rank 0 in world size 2" in (roots["host-a"] / ".rollout" / "vllm.log").read_text()
            headless = json.loads((roots["host-b"] / ".rollout" / "server.json").read_text())["command"]
            assert "tasks.vllm.headless" in headless and headless[headless.index("--node-rank") + 1] == "1"
            assert not _serves(ports["host-b"], repo_id)  # host-b's own server gave its GPUs to the group
            reply = httpx.post(f"http://127.0.0.1:{ports['host-a']}/v1/completions", timeout=60, json={
                "model": repo_id, "prompt": "41 42 43", "max_tokens": 3, "temperature": 0}).json()
            assert reply["choices"][0]["text"] == " 44 45 46"  # the two nodes together answer right
            assert [g["host"] for g in read_last_good(roots["host-a"] / ".rollout").group] == ["host-b"]
    assert "bulk DML" not in server_log.read_text()

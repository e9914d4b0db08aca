"""`tune-model` on vLLM CPU with the demo model: four candidates, one refused by vLLM's parser, one
that starts and fails, two measured; a re-run measures nothing; a promoted winner is deployed."""

from __future__ import annotations

import time

import pytest
import yaml
from conftest import artifact, vllm_processes
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from testkit.cli_args import cli_args
from typer.testing import CliRunner

from flows.cli import app
from flows.demo import demo_config
from flows.deploy import deploy_model
from flows.tune import TuneConfig, tune_model
from tasks.tuning.measure import CandidateResult, winner
from tasks.tuning.space import Layout, TuneSpace, candidates
from tasks.vllm.process import reap_stale, serving_group
from tasks.vllm.settings import VllmSettings


def _logs_of(run_id, wait_s: float = 20.0) -> list:
    """The run's logs; the API stores log batches asynchronously: poll briefly for the one asked."""
    log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id]))
    deadline = time.monotonic() + wait_s
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            logs = client.read_logs(log_filter=log_filter)
            if any(log.message.startswith("unavailable during") for log in logs):
                return logs
            time.sleep(0.2)
    return logs


SPACE = TuneSpace(layouts=[Layout(tensor_parallel_size=1)], max_num_seqs=[2, 16],
                  extra=[{"kv_cache_dtype": "fp9"}, {"max_model_len": 100000}])


def _task_states(flow_run_id) -> dict[str, str]:
    """The run's task states once every one is final: task states reach the server as events, and
    under load a Cached task was read back as Running a moment after its flow returned."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + 60
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            if all(t.state and t.state.is_final() for t in runs) or time.monotonic() > deadline:
                break
            time.sleep(1)
    return {t.name: t.state_name for t in runs}


def test_the_default_space_is_ordered_likeliest_first_and_varies_ep_options_only_with_ep():
    space = TuneSpace(all2all_backend=[None, "deepep_low_latency"], max_num_seqs=[256])
    found = candidates(VllmSettings(enable_expert_parallel=True), space)
    a2a = ", --all2all-backend deepep_low_latency"
    layouts = ["TP=8 + EP", "TP=4 x DP=2 + EP", "TP=2 x DP=4 + EP", "TP=1 x DP=8 + EP"]
    assert [c.name for c in found] == [name + ", max_num_seqs=256" + extra for name in layouts for extra in ("", a2a)
                                       ] + ["TP=8, max_num_seqs=256"]  # no all2all backend without EP
    assert found[1].settings.extra_args == ["--all2all-backend", "deepep_low_latency"]
    assert (found[2].settings.tensor_parallel_size, found[2].settings.data_parallel_size) == (4, 2)


def test_the_winner_is_the_best_peak_and_a_near_tie_goes_to_the_faster_single_stream():
    def result(name, peak, single, status="measured"):
        return CandidateResult(name=name, settings=VllmSettings(), status=status, peak_tok_s=peak,
                               single_stream_tok_s=single)

    wide = result("TP=8 + EP", 2276.0, 82.0)
    near = result("TP=4 x DP=2 + EP", 2250.0, 95.0)  # 1.1% below the best peak, much faster alone
    slow = result("TP=8", 1500.0, 120.0)
    refused = result("TP=1 x DP=8 + EP", None, None, "refused")
    assert winner([wide, near, slow, refused]) is near
    assert winner([wide, result("x", 2000.0, 95.0), slow]) is wide  # 12% below: peak wins
    assert winner([wide, near, slow], "single-stream") is slow
    assert winner([refused]) is None


@pytest.mark.usefixtures("prefect_server")
def test_tune_refuses_measures_resumes_and_promotes(local_hub, tmp_path):
    deploy = demo_config(local_hub.endpoint, tmp_path / "models", concurrency_levels=[1, 4], level_duration_s=1.5,
                         under_load=False)  # the answer check's load is test_answers_rollout's
    config = TuneConfig(deploy=deploy, space=SPACE)
    state = tune_model(config, return_state=True)
    results = state.result()
    assert [r.name for r in results] == ["TP=1 + EP, max_num_seqs=2", "TP=1 + EP, max_num_seqs=16",
                                         "TP=1 + EP, kv_cache_dtype=fp9", "TP=1 + EP, max_model_len=100000"]
    refused, failed = results[2], results[3]
    assert refused.status == "refused" and refused.cause == "invalid-argument" and refused.seconds < 1.0
    assert "--kv-cache-dtype" in refused.detail and "fp9" in refused.detail
    assert failed.status == "failed" and failed.cause == "max-model-len-too-long", failed.detail[-500:]
    assert "max_model_len (100000)" in failed.detail
    for r in results[:2]:
        assert r.status == "measured" and r.peak_tok_s > 0 and r.single_stream_tok_s > 0
        assert r.startup_s > 0 and r.accuracy >= 0.9
    summary = artifact("tune-demo-tiny-moe").data
    best = winner(results)  # the best peak; within 2% of it, the faster single stream
    first = summary.splitlines()[0]
    assert best in results[:2] and first.startswith(f"# Winner: {best.name}: ")
    assert "![Throughput per GPU against tok/s per user](data:image/png;base64,iVBOR" in summary
    rows = artifact("tune-table-demo-tiny-moe").data
    assert "max-model-len-too-long" in rows and "invalid-argument" in rows
    assert vllm_processes() == []

    # Again, from the shell with --promote: every measurement is a cached task result; nothing
    # starts, the same winner. The flags are the form's, as a user types them.
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE.model_dump(mode="json", exclude_defaults=True)))
    log = deploy.run_dir / "vllm.log"  # each vLLM start writes it anew
    written = log.stat().st_mtime_ns
    again = CliRunner().invoke(app, ["tune", *cli_args(deploy), "--space", str(space), "--promote"])
    assert again.exit_code == 0, again.output
    assert log.stat().st_mtime_ns == written
    assert again.stdout.rstrip().endswith(f"winner: {best.name} (promoted: the next deploy of this model here uses it)")
    assert "None" not in again.stdout and "max-model-len-too-long" in again.stdout
    states = _task_states(artifact("tune-demo-tiny-moe").flow_run_id)
    assert {n: s for n, s in states.items() if n.startswith("measure ")} == {  # the failed start too
        "measure TP=1 + EP, max_num_seqs=2": "Cached", "measure TP=1 + EP, max_num_seqs=16": "Cached",
        "measure TP=1 + EP, max_model_len=100000": "Cached"}
    assert artifact("tune-demo-tiny-moe").data.splitlines()[0] == first

    # Promoted: the next deploy of the model serves with the winner's settings.
    deploy_model(deploy.model_copy(update={"keep_serving": True, "bench": deploy.bench.model_copy(
        update={"concurrency_levels": [1]})}))
    assert f"--max-num-seqs {best.settings.max_num_seqs}" in artifact("server-demo-tiny-moe").data
    serving = serving_group(deploy.run_dir / "server.json")
    try:
        # A search whose every result is cached leaves the serving model alone: no stop, no restart.
        cached = CliRunner().invoke(app, ["tune", *cli_args(deploy), "--space", str(space), "--promote"])
        assert cached.exit_code == 0, cached.output
        assert serving_group(deploy.run_dir / "server.json") == serving is not None  # a restart: a new group
        # A candidate never measured: the serving model is stopped for it and started again after,
        # and the run says how long the host answered nothing.
        fresh = TuneConfig(deploy=deploy.model_copy(update={"bench": deploy.bench.model_copy(
            update={"concurrency_levels": [1]})}), space=TuneSpace(layouts=[Layout(tensor_parallel_size=1)],
                                                                   max_num_seqs=[8]))
        state = tune_model(fresh, return_state=True)
        assert [r.status for r in state.result()] == ["measured"]
        assert serving_group(deploy.run_dir / "server.json") not in (None, serving)  # started again
        messages = [log.message for log in _logs_of(state.state_details.flow_run_id)]
        assert any(m.startswith("unavailable during the tune: ") and " s without an answer" in m
                   for m in messages), messages
    finally:
        reap_stale(deploy.run_dir / "server.json")
    assert vllm_processes() == []


@pytest.mark.usefixtures("prefect_server")
def test_tune_with_nothing_measured_exits_1(local_hub, tmp_path):
    """Every candidate refused in milliseconds: no winner is no success."""
    deploy = demo_config(local_hub.endpoint, tmp_path / "models")
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"layouts": [{"tensor_parallel_size": 1}], "kv_cache_dtype": ["fp9"]}))
    result = CliRunner().invoke(app, ["tune", *cli_args(deploy), "--space", str(space)])
    assert result.exit_code == 1, result.output
    assert result.stderr.strip().splitlines()[-1] == ("error: no winner: no candidate was measured (each one's "
                                                       "cause is in the table)")
    assert "invalid-argument" in result.stdout and "None" not in result.stdout
    assert vllm_processes() == []

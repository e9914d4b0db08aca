"""`tune-model` on vLLM CPU with the demo model: four candidates, one refused by vLLM's parser, one
that starts and fails, two measured; a re-run measures nothing; a promoted winner is deployed."""

from __future__ import annotations

import pytest
from conftest import artifact, vllm_processes

from flows.demo import demo_config
from flows.deploy import deploy_model
from flows.tune import TuneConfig, tune_model
from tasks.tuning.measure import CandidateResult, winner
from tasks.tuning.space import Layout, TuneSpace, candidates
from tasks.vllm.settings import VllmSettings

SPACE = TuneSpace(layouts=[Layout(tensor_parallel_size=1)], max_num_seqs=[2, 16],
                  extra=[{"kv_cache_dtype": "fp9"}, {"max_model_len": 100000}])


def _task_states(flow_run_id) -> dict[str, str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
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
    deploy = demo_config(local_hub.endpoint, tmp_path / "models", concurrency_levels=[1, 4], level_duration_s=1.5)
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

    # Again: every measurement is a cached task result; nothing starts, the same winner.
    log = deploy.run_dir / "vllm.log"  # each vLLM start writes it anew
    written = log.stat().st_mtime_ns
    again_state = tune_model(config.model_copy(update={"promote": True}), return_state=True)
    again = again_state.result()
    assert log.stat().st_mtime_ns == written
    states = _task_states(again_state.state_details.flow_run_id)
    assert {n: s for n, s in states.items() if n.startswith("measure ")} == {  # the failed start too
        "measure TP=1 + EP, max_num_seqs=2": "Cached", "measure TP=1 + EP, max_num_seqs=16": "Cached",
        "measure TP=1 + EP, max_model_len=100000": "Cached"}
    assert [(r.name, r.status, r.cause, r.peak_tok_s) for r in again] == [
        (r.name, r.status, r.cause, r.peak_tok_s) for r in results]
    assert artifact("tune-demo-tiny-moe").data.splitlines()[0] == first

    # Promoted: the next deploy of the model serves with the winner's settings.
    deploy_model(deploy.model_copy(update={"bench": deploy.bench.model_copy(update={"concurrency_levels": [1]})}))
    assert f"--max-num-seqs {best.settings.max_num_seqs}" in artifact("server-demo-tiny-moe").data
    assert vllm_processes() == []

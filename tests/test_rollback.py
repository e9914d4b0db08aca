"""A deploy that fails after the old server stopped brings the old one back (real vLLM CPU servers)."""

from __future__ import annotations

import httpx
import pytest
from conftest import artifact, vllm_processes
from prefect.blocks.notifications import CustomWebhookNotificationBlock
from typer.testing import CliRunner

from flows.cli import app
from flows.demo import BF16_REPO, demo_config
from flows.deploy import deploy_model
from flows.nightly import nightly_refresh
from tasks.artifacts import read_history
from tasks.errors import RegressionError
from tasks.history.last_good import read_last_good, write_last_good
from tasks.vllm.process import reap_stale, serving_group

pytestmark = pytest.mark.usefixtures("prefect_server")
QUICK = dict(concurrency_levels=[1, 2], requests_per_level=4, keep_serving=True)


def _served(base_url: str) -> list[str]:
    return [m["id"] for m in httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"]]


def test_nightly_regression_rolls_back_to_the_serving_deployment(local_hub, tmp_path, webhook):
    config = demo_config(local_hub.endpoint, tmp_path / "models", **QUICK)
    state = config.run_dir / "server.json"
    # The shipped automations, through a webhook block pointed at the local receiver.
    CustomWebhookNotificationBlock(name="rollout test", url=webhook.url, allow_private_urls=True,
                                   json_data={"subject": "{{subject}}", "body": "{{body}}"}).save("rollout-test",
                                                                                                  overwrite=True)
    assert CliRunner().invoke(app, ["notify", "--block", "custom-webhook/rollout-test"]).exit_code == 0
    try:
        first = deploy_model(config)
        good = read_last_good(config.run_dir)
        assert first.base_url and _served(first.base_url) == [BF16_REPO]  # it keeps serving after the flow
        assert good.serving_pgid == serving_group(state) and good.record.peak_tok_s > 0

        # Planted: the good deployment was from an older commit and benchmarked 1000x faster, so the
        # nightly sees a new commit, stops the old server, deploys, and measures a regression.
        # Its intervals are scaled with it: left as measured they overlap the new run's, and the gate
        # rightly calls the drop noise.
        def faster(value):
            return value and (value * 1000 if isinstance(value, float) else (value[0] * 1000, value[1] * 1000))

        was = good.record
        planted = was.model_copy(update={"commit": "0" * 40} | {
            field: faster(getattr(was, field)) for field in ("peak_tok_s", "single_stream_tok_s", "peak_ci",
                                                              "single_stream_ci")})
        write_last_good(config.run_dir, good.model_copy(update={"commit": "0" * 40, "record": planted}))
        with pytest.raises(RegressionError, match=r"regressed against 000000000000 .* outside the noise"):
            nightly_refresh(config)

        back = read_last_good(config.run_dir)
        assert back.commit == "0" * 40 and back.serving_pgid == serving_group(state) != good.serving_pgid
        assert _served(first.base_url) == [BF16_REPO]  # the same address serves the previous model again
        completion = httpx.post(f"{first.base_url}/v1/completions", timeout=60,
                                json={"model": BF16_REPO, "prompt": "hi", "max_tokens": 2}).json()
        assert completion["usage"]["completion_tokens"] == 2
        rollback = artifact("rollback-demo-tiny-moe").data
        assert f"# Rolled back to {BF16_REPO}@000000000000" in rollback
        assert "RegressionError" in rollback and f"**Serving again:** `{BF16_REPO}`" in rollback
        assert first.base_url in rollback
        nightly = artifact("nightly-demo-tiny-moe").data
        assert "**Failed:**" in nightly and "beyond 10%, outside the noise" in nightly
        assert f"**Serving:** the last good deployment, `{BF16_REPO}@{'0' * 40}`" in nightly
        runs = [r for r in read_history(BF16_REPO) if r.commit == first.prepared.commit]
        assert [r.status for r in runs[-2:]] == ["passed", "regressed"]

        # The deploy run's own summary says so in its first line, and why.
        summary = artifact("deploy-demo-tiny-moe")
        first_line = summary.data.splitlines()[0]
        assert first_line.startswith(f"# Rolled back: {BF16_REPO}@{first.prepared.commit[:12]} failed at the "
                                     "regression gate: RegressionError:")
        assert "serves again" in first_line and "000000000000" in first_line
        assert nightly.startswith(f"# Failed: {BF16_REPO}@") and "The deploy run: [" in nightly

        # The automations told a person: the rollback and the failed nightly, each once.
        posts = webhook.wait_for(2)
        rolled = [p for p in posts if p["subject"].startswith("Rolled back on ")]
        nightly = [p for p in posts if p["subject"].startswith("Nightly refresh failed: nightly tiny-moe@")]
        assert len(rolled) == 1 and len(nightly) == 1, posts
        assert first_line.removeprefix("# ") in rolled[0]["body"] and "/runs/flow-run/" in rolled[0]["body"]
        assert "Failed" in nightly[0]["body"] and "/runs/flow-run/" in nightly[0]["body"]
    finally:
        reap_stale(state)
    assert vllm_processes() == []

"""The Prefect UI in a real browser: what an engineer reading a deploy's history sees.

A real `prefect server start` (the test harness serves no UI), one demo deploy reported to it, then
Debian's Chromium driven by Playwright. Screenshots land in test-output/ui/ for a person to look at.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import httpx
import pytest
from conftest import vllm_processes

from flows.demo import BF16_REPO, INT4_REPO
from testkit.browser import CHROMIUM, SHOTS, chromium_page
from testkit.prefect_processes import prefect_server


@pytest.fixture(scope="module")
def ui_server(tmp_path_factory):
    """A Prefect server with its UI, on its own database: (its URL, the environment that reports to it)."""
    home = tmp_path_factory.mktemp("prefect-ui")
    with prefect_server(home, ui=True) as (api, _):
        url = api.removesuffix("/api")
        yield url, {**os.environ, "PREFECT_API_URL": api, "PREFECT_UI_URL": url}


# One deploy of the demo model, the INT4 variant staged, and the compare flow, as a user's runs would
# report them to this server.
RUNS = textwrap.dedent("""
    import sys
    from pathlib import Path
    from flows.compare import CompareConfig, compare_runs
    from flows.demo import INT4_REPO, demo_config
    from flows.deploy import deploy_model
    from flows.prepare import prepare_model
    endpoint, models = sys.argv[1], Path(sys.argv[2])
    prepare_model(demo_config(endpoint, models, repo_id=INT4_REPO))
    deploy_model(demo_config(endpoint, models, concurrency_levels=[1, 2, 4], level_duration_s=2.0, max_regression=None))
    compare_runs(CompareConfig())
""")


def _newest_artifact(api: str, key: str) -> dict:
    found = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"key": {"any_": [key]}}, "sort": "CREATED_DESC",
                                                        "limit": 1}, timeout=10).json()
    assert found, f"no artifact {key}"
    return found[0]


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium: `apt-get install chromium` (.ci/run installs it)")
def test_a_deploy_reads_in_the_prefect_ui(ui_server, local_hub, tmp_path):
    url, env = ui_server
    api = f"{url}/api"
    ran = subprocess.run([sys.executable, "-c", RUNS, local_hub.endpoint, str(tmp_path / "models")], env=env,
                         capture_output=True, text=True, timeout=900)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert vllm_processes() == []

    # Runs are named for what they ran and tagged; the model tag filters exactly that model's runs.
    def runs_tagged(tag: str) -> list[dict]:
        return httpx.post(f"{api}/flow_runs/filter", json={"flow_runs": {"tags": {"all_": [tag]}}},
                          timeout=10).json()

    deploys = runs_tagged(f"model:{BF16_REPO}")
    staged = runs_tagged(f"model:{INT4_REPO}")
    everything = httpx.post(f"{api}/flow_runs/filter", json={}, timeout=10).json()
    assert len(everything) == 3 and len(deploys) == 1 and len(staged) == 1
    run = deploys[0]
    assert run["name"] == f"tiny-moe@{run['name'].split('@')[1].split()[0]} on {socket.gethostname()}"
    assert {"revision:main", f"host:{socket.gethostname()}", "trigger:cli"} <= set(run["tags"])
    assert staged[0]["name"].startswith("tiny-moe-int4@")

    summary = _newest_artifact(api, "deploy-demo-tiny-moe")
    assert summary["flow_run_id"] == run["id"]
    _read_in_browser(url, run, summary["id"], _newest_artifact(api, "run-comparison-summary")["id"])


def _read_in_browser(url: str, run: dict, summary_id: str, comparison_id: str) -> None:
    """What an engineer does: the run, its task runs and artifacts, the summary, the table, the history."""
    from playwright.sync_api import expect

    with chromium_page() as page:
        # The run page: its name, then its task runs and its artifacts.
        page.goto(f"{url}/runs/flow-run/{run['id']}")
        expect(page.get_by_text(run["name"]).first).to_be_visible()
        page.locator("li.p-tab", has_text="Task Runs").click()
        expect(page.get_by_text("start-vllm").first).to_be_visible()
        expect(page.get_by_text("bench c=1").first).to_be_visible()
        page.screenshot(path=SHOTS / "run-task-runs.png")
        page.locator("li.p-tab", has_text="Artifacts").click()
        expect(page.get_by_text("deploy-demo-tiny-moe").first).to_be_visible()
        page.screenshot(path=SHOTS / "run-artifacts.png")

        # The deploy summary: the verdict first, the chart loaded in the page.
        page.goto(f"{url}/artifacts/artifact/{summary_id}")
        heading = page.locator("h1", has_text="Passed:").first
        expect(heading).to_be_visible()
        assert heading.inner_text().startswith("Passed: demo/tiny-moe@")
        chart = page.locator("img[alt='Throughput and latency against concurrency']")
        expect(chart).to_be_visible()
        assert chart.evaluate("img => img.complete && img.naturalWidth") > 0
        page.screenshot(path=SHOTS / "deploy-summary.png")
        chart.scroll_into_view_if_needed()
        chart.screenshot(path=SHOTS / "deploy-chart.png")

        # Its link to the benchmark table (the UI opens it in a new tab) leads to a page showing it.
        with page.context.expect_page() as opened:
            page.locator("a", has_text="bench-demo-tiny-moe").first.click()
        table = opened.value
        table.wait_for_load_state()
        expect(table.get_by_text("bench-demo-tiny-moe").first).to_be_visible()
        expect(table.locator("th", has_text="output tok/s").first).to_be_visible()
        expect(table.locator("th", has_text="TTFT median ms").first).to_be_visible()
        expect(table.locator("td", has_text="±").first).to_be_visible()
        table.screenshot(path=SHOTS / "bench-table.png")
        table.close()

        # The compare flow's summary carries the history chart.
        page.goto(f"{url}/artifacts/artifact/{comparison_id}")
        history = page.locator("img[alt='Throughput and p99 TTFT per revision over time']")
        expect(history).to_be_visible()
        assert history.evaluate("img => img.complete && img.naturalWidth") > 0
        page.screenshot(path=SHOTS / "history.png")

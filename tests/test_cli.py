"""Bad command-line input: one line naming the option, exit 2, nothing started."""

import json

import pytest
from typer.testing import CliRunner

from flows.cli import app

runner = CliRunner()


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--tp", "0"], "bad option --tp: Input should be greater than or equal to 1"),  # as typed
        (["--concurrency", "1,x"], "bad option --concurrency '1,x'"),
        (["--tensor-parallel-size", "0"], "bad option --tensor-parallel-size: Input should be"),
        (["--concurrency", "0,4"], "bad option --concurrency: every concurrency level must be >= 1"),
        (["--output-len", "1"], "bad option --output-len"),
        (["--max-regression", "2"], "bad option --max-regression"),
        (["--max-model-len", "1024"], "error: --input-len 1024 + --output-len 256 = 1280 tokens per request, beyond "
                                      "--max-model-len 1024: every request would be refused"),
        (["--answers-min-accuracy", "2"], "bad option --answers-min-accuracy: Input should be less than or equal to 1"),
    ],
)
def test_bad_deploy_options_name_the_option(args, expected, tmp_path, monkeypatch):
    command = ["deploy", "org/model", "--models-root", str(tmp_path), *args]
    monkeypatch.setattr("sys.argv", ["rollout", *command])  # the flag named is the one typed
    result = runner.invoke(app, command)
    assert result.exit_code == 2
    assert expected in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.quiet
def test_bench_sweeps_any_openai_server_until_it_saturates(tmp_path):
    from testkit.openai_server import StreamingServer

    out = tmp_path / "results"
    with StreamingServer(ttft_s=0.03, itl_s=0.005, slots=4) as server:  # 4 slots: throughput stops at 4
        result = runner.invoke(app, ["bench", "--base-url", server.base_url + "/v1", "--model", "fake",
                                     "--vocab-size", "1000", "--input-len", "16", "--output-len", "24",
                                     "--requests-per-level", "16", "--max-concurrency", "64",
                                     "--results-dir", str(out)])
    assert result.exit_code == 0, result.output
    assert "- Sweep ended: saturated at concurrency 8" in result.output
    assert "- Peak (knee): " in result.output and "- Single stream: " in result.output
    assert "- queued at concurrency 8: requests waited in vLLM's queue" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["chart.png", "level-c0001.json", "level-c0002.json",
                                                     "level-c0004.json", "level-c0008.json", "results.csv",
                                                     "summary.md"]
    assert "queued" in result.output.split("c=8:")[1].splitlines()[0]  # the server's queue, seen in /metrics


@pytest.mark.parametrize(
    "args, code, expected",
    [
        (["--model", "other", "--vocab-size", "1000"], 1, "--model 'other' is not served at"),
        (["--model", "fake", "--dataset", "/nonexistent.jsonl"], 2, "/nonexistent.jsonl: not JSONL of"),
        (["--model", "fake", "--vocab-size", "1000", "--output-len", "1"], 2, "bad option --output-len"),
        (["--model", "fake", "--vocab-size", "1000", "--client-cpus", "0-"], 2, "bad option --client-cpus"),
    ],
)
def test_bench_refuses_bad_input_in_one_line(args, code, expected, tmp_path):
    from testkit.openai_server import StreamingServer

    with StreamingServer() as server:
        result = runner.invoke(app, ["bench", "--base-url", server.base_url, *args, "--results-dir", str(tmp_path)])
    assert result.exit_code == code
    assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tokenizer", [False, True])
def test_bench_sends_text_to_a_server_that_refuses_token_ids(tokenizer, hub_root, tmp_path):
    from testkit.openai_server import StreamingServer

    extra = ["--tokenizer", str(hub_root / "demo" / "tiny-moe")] if tokenizer else []
    with StreamingServer(ttft_s=0.01, itl_s=0.002, rejects="token-ids") as server:
        result = runner.invoke(app, ["bench", "--base-url", server.base_url, "--model", "fake", "--vocab-size", "1000",
                                     "--input-len", "16", "--output-len", "8", "--requests-per-level", "4",
                                     "--concurrency", "1,2", "--results-dir", str(tmp_path), *extra])
    assert result.exit_code == 0, result.output + result.stderr
    assert "refuses token-id prompts: sending text" in result.output
    levels = [json.loads((tmp_path / f"level-c000{c}.json").read_text()) for c in (1, 2)]
    assert all(level["completed"] == 4 and level["failed"] == 0 for level in levels)
    assert all(level["total_input_tokens"] > 0 for level in levels)  # the server's own counts of the text


@pytest.mark.parametrize("tokenizer", [False, True])
def test_bench_against_a_server_that_refuses_everything_quotes_it_in_one_line(tokenizer, hub_root, tmp_path):
    from testkit.openai_server import StreamingServer

    extra = ["--tokenizer", str(hub_root / "demo" / "tiny-moe")] if tokenizer else []
    with StreamingServer(rejects="all") as server:
        result = runner.invoke(app, ["bench", "--base-url", server.base_url, "--model", "fake", "--vocab-size", "1000",
                                     "--results-dir", str(tmp_path), *extra])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: {server.base_url} refuses the benchmark's requests: HTTP400: model "
                                    "'fake' is overloaded")
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []


def test_bench_names_an_unreachable_server():
    result = runner.invoke(app, ["bench", "--base-url", "http://127.0.0.1:9", "--model", "m", "--vocab-size", "10"])
    assert result.exit_code == 2 and "--base-url http://127.0.0.1:9: no OpenAI model list" in result.stderr


@pytest.mark.usefixtures("prefect_server")
def test_prepare_stages_a_model_without_the_gpus(local_hub, tmp_path):
    import json

    result = runner.invoke(app, ["prepare", "demo/tiny-moe-int4", "--endpoint", local_hub.endpoint,
                                 "--models-root", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    prepared = json.loads(result.stdout)
    assert prepared["validation"]["verdict"] == "pass" and prepared["validation"]["modules_packed"] > 0
    model_dir = tmp_path / "hub" / "models--demo--tiny-moe-int4" / "snapshots" / prepared["commit"]
    assert prepared["model_dir"] == str(model_dir) and (model_dir / "config.json").exists()
    assert not (tmp_path / ".rollout" / "server.json").exists()  # nothing was started


def test_prepare_names_a_repo_that_does_not_exist(local_hub, tmp_path):
    result = runner.invoke(app, ["prepare", "demo/absent", "--endpoint", local_hub.endpoint,
                                 "--models-root", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"error: repo demo/absent not found on {local_hub.endpoint} (private repos need HF_TOKEN)"]
    assert list(tmp_path.iterdir()) == []


def test_tune_refuses_a_bad_space_file_or_option_in_one_line_naming_it(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("layouts:\n  - tensor_parallel_size: 0\n")
    for args, says in ((["--space", str(space)], f"error: --space {space}: layouts.0.tensor_parallel_size: "),
                       (["--space", str(tmp_path / "none.yaml")], f"error: --space {tmp_path / 'none.yaml'}: "
                                                                   "FileNotFoundError"),
                       (["--winner-rule", "fastest"], "error: bad option --winner-rule: ")):
        result = runner.invoke(app, ["tune", "demo/x", *args])
        assert result.exit_code == 2 and result.stderr.startswith(says), result.output
        assert len(result.stderr.splitlines()) == 1


def test_an_unreachable_prefect_api_is_one_line_naming_it_within_30_s(tmp_path):
    import os
    import subprocess
    import sys
    import time

    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "flows.cli", "deploy", "demo/tiny-moe", "--models-root",
                           str(tmp_path / "models")], env=env, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - started < 30
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "error: the Prefect API at http://127.0.0.1:9/api (PREFECT_API_URL) does not answer (ConnectError: [Errno 111] "
        "Connection refused): start it, or unset PREFECT_API_URL to run on the embedded server"], done.stderr
    assert not (tmp_path / "models").exists()


def test_a_models_root_whose_parent_does_not_exist_is_refused_before_anything(tmp_path):
    typo = tmp_path / "modles" / "kimi"
    for command in (["deploy", "org/model"], ["prepare", "org/model"], ["tune", "org/model"]):
        result = runner.invoke(app, [*command, "--models-root", str(typo)])
        assert result.exit_code == 2, result.output
        assert result.stderr.splitlines() == [f"error: --models-root {typo}: its parent {typo.parent} does not exist "
                                              "(a typo?); create the folder first if it is meant"]
    assert list(tmp_path.iterdir()) == []


def test_notify_names_a_block_without_its_type():
    result = runner.invoke(app, ["notify", "--block", "ops"])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == ["error: --block 'ops': expected <block-type>/<block-name>, e.g. "
                                          "slack-webhook/ops"]


def test_help_never_cuts_a_flag_name():
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "flows.cli", "deploy", "--help"], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "80"}, timeout=60)
    assert done.returncode == 0 and "…" not in done.stdout
    assert "--data-parallel-size " in done.stdout and "--data-parallel-size-local" in done.stdout
    assert "--answers-probes" in done.stdout

"""`rollout demo`: the whole pipeline on this machine, with nothing but loopback.

A tiny Kimi-K2.5-shaped checkpoint (bf16, and an INT4 variant in the real compressed-tensors
layout) is published by a local Hub look-alike, then deploy_model runs on it with vLLM on the CPU.
vLLM's CPU build has no INT4 MoE kernel, so the INT4 variant is fetched and validated, not served.
"""

from __future__ import annotations

import os
from pathlib import Path

from flows.demo.checkpoint import PROBES_FILE, build_bf16, build_int4, reference_text

BF16_REPO = "demo/tiny-moe"
INT4_REPO = "demo/tiny-moe-int4"


def build_demo_repos(hub_root: Path, say=lambda line: None) -> None:
    """Create both repos once; a re-run reuses them (same files, same commit sha). `say` hears what
    takes a while: the first run trains the tiny model for a few minutes on two cores."""
    bf16 = hub_root / BF16_REPO
    if not (bf16 / "config.json").exists():
        say(f"building {BF16_REPO}: training a tiny MoE to count and continue cycles (about a minute on 2 cores, "
                "once)")
        build_bf16(bf16)
    int4 = hub_root / INT4_REPO
    if not (int4 / "config.json").exists():
        say(f"building {INT4_REPO}: its experts quantized to INT4 in the compressed-tensors layout")
        build_int4(bf16, int4)


def demo_config(endpoint: str, models_root: Path, **overrides):
    """The demo's DeployConfig; an override named like a VllmSettings or BenchSpec field goes there."""
    from tasks.answers.spec import AnswerSpec
    from tasks.bench.spec import BenchSpec
    from tasks.cpus import server_and_client_cpus
    from tasks.deployment.config import DeployConfig
    from tasks.vllm.settings import VllmSettings

    # Eager: torch.compile takes ~35 s of every start on two cores, for a model that loads in 0.02 s.
    # vLLM on every core but one, the benchmark client on that one: sharing cores, vLLM's API process
    # fell behind and sent each request's tokens as one chunk, and the client's timestamps waited
    # for the scheduler (README, "The demo's numbers").
    server_cpus, client_cpus = server_and_client_cpus()
    # A KV cache of ~36K tokens (2,304 bytes a token: MLA's 576 bf16 values in 2 layers), not 1 GiB's
    # 466K: the sweep's 256 x 96 tokens fit, and the answer check under load fills it with 34
    # requests, not 256 that never reach 90%.
    # One worker, run inside the engine process (vLLM's uniproc executor, which its CPU build allows
    # only with VLLM_ENABLE_V1_MULTIPROCESSING=0): a third Python process's imports cost ~6 s of an
    # ~18 s start on two cores (12 s without). GPU hosts keep vLLM's default.
    vllm = dict(tensor_parallel_size=1, enable_expert_parallel=True, max_model_len=1024, enforce_eager=True,
                cpus=server_cpus, kv_cache_memory_bytes=80 * 2**20, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    vllm |= {k: overrides.pop(k) for k in list(overrides) if k in VllmSettings.model_fields}
    # Two CPU cores saturate early; the demo sweeps until throughput stops growing. A level of 3 s
    # holds ten or more requests per slot at the demo model's pace: a steady state to measure.
    bench = dict(concurrency_levels=[1, 2, 4, 8, 16, 32, 64, 128, 256], level_duration_s=3.0, input_len=64,
                 output_len=32, client_cpus=client_cpus)
    bench |= {k: overrides.pop(k) for k in list(overrides) if k in BenchSpec.model_fields}
    settings = dict(
        repo_id=BF16_REPO,
        models_root=models_root,
        hub_endpoint=endpoint,
        disk_margin_gb=0.1,
        vllm=VllmSettings(**vllm),
        port=0,
        startup_timeout_s=600,
        bench=BenchSpec(**bench),
        # The model counts on and continues cycles: its own probes, and a counting text whose perplexity
        # drifts when it breaks.
        answers=AnswerSpec(probes=Path(PROBES_FILE), reference_text=reference_text(), max_tokens=6),
        keep_serving=False,  # the demo ends with nothing running
    )
    return DeployConfig(**{**settings, **overrides})


def run_demo(work_dir: Path, say=lambda line: None):
    """Returns (INT4 PreparedModel, bf16 DeployResult)."""
    from flows.demo.hub_server import LocalHub  # here: `python -m flows.demo.hub_server` imports this package first
    from flows.deploy import deploy_model
    from flows.prepare import prepare_model

    hub_root = work_dir / "hub"
    build_demo_repos(hub_root, say)
    say(f"serving {hub_root} as a local Hub; deploying {BF16_REPO} on vLLM (CPU)")
    with LocalHub(hub_root) as hub:
        os.environ["HF_ENDPOINT"] = hub.endpoint  # for anything in this process tree that asks the Hub
        int4 = prepare_model(demo_config(hub.endpoint, work_dir / "models", repo_id=INT4_REPO))
        # No regression gate: on two shared cores vLLM and the client fight for the CPU, and the same
        # commit's peak throughput moved 4x between runs (389 vs 1487 tok/s). The result still says
        # how it compares with the previous demo run (DeployResult.record.compared).
        result = deploy_model(demo_config(hub.endpoint, work_dir / "models", max_regression=None))
    return int4, result

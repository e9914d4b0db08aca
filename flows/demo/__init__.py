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
# The tiny Kimi-K2.5 (flows/demo/kimi.py): Kimi's config, tokenizer code, template and parsers.
KIMI_REPO = "demo/tiny-kimi-k2.5"
KIMI_INT4_REPO = "demo/tiny-kimi-k2.5-int4"


def build_demo_repos(hub_root: Path, say=lambda line: None, *, kimi: bool = True) -> None:
    """Create the four repos once (the first two with `kimi` off); a re-run reuses them (same files,
    same commit sha). `say` hears what takes a while: the first run trains the two tiny models for
    about a minute each on two cores."""
    from flows.demo.kimi_model import build_kimi_bf16, build_kimi_int4

    steps = [
        (BF16_REPO, lambda out: build_bf16(out),
         "training a tiny MoE to count and continue cycles (about a minute on 2 cores, once)"),
        (INT4_REPO, lambda out: build_int4(hub_root / BF16_REPO, out),
         "its experts quantized to INT4 in the compressed-tensors layout"),
        (KIMI_REPO, lambda out: build_kimi_bf16(out), "Kimi-K2.5's layout, tokenizer and template, trained to answer "
                                                      "by completion, chat, reasoning and tool call (about a minute, once)"),
        (KIMI_INT4_REPO, lambda out: build_kimi_int4(hub_root / KIMI_REPO, out),
         "its experts in INT4, the block in text_config as Kimi-K2.5 keeps it"),
    ]
    for repo, build, what in steps[:None if kimi else 2]:
        if not (hub_root / repo / "config.json").exists():
            say(f"building {repo}: {what}")
            build(hub_root / repo)


def demo_config(endpoint: str, models_root: Path, **overrides):
    """The demo's DeployConfig; an override named like a VllmSettings, BenchSpec or AnswerSpec field
    goes there."""
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
    answers = {k: overrides.pop(k) for k in list(overrides) if k in AnswerSpec.model_fields}
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
        answers=AnswerSpec(**{"probes": Path(PROBES_FILE), "reference_text": reference_text(), "max_tokens": 6,
                              **answers}),
        keep_serving=False,  # the demo ends with nothing running
    )
    return DeployConfig(**{**settings, **overrides})


def kimi_demo_config(endpoint: str, models_root: Path):
    """The tiny Kimi-K2.5's deploy: the demo's settings, the demo's consent to the tokenizer code it
    wrote itself (a deploy says so in one line and records it), and a shorter sweep."""
    return demo_config(endpoint, models_root, repo_id=KIMI_REPO, trust_remote_code=True, max_regression=None,
                       concurrency_levels=[1, 2, 4, 8], level_duration_s=2.0)


def run_demo(work_dir: Path, say=lambda line: None, *, kimi: bool = True) -> list:
    """[INT4 PreparedModel, bf16 DeployResult, Kimi INT4 PreparedModel, Kimi DeployResult]; with
    `kimi` off, the last two are None (the suite deploys the tiny Kimi through the CLI instead)."""
    from flows.demo.hub_server import LocalHub  # here: `python -m flows.demo.hub_server` imports this package first
    from flows.deploy import deploy_model
    from flows.prepare import prepare_model

    hub_root = work_dir / "hub"
    build_demo_repos(hub_root, say, kimi=kimi)
    say(f"serving {hub_root} as a local Hub; deploying {BF16_REPO}" + (f", then {KIMI_REPO}," if kimi else "")
        + " on vLLM (CPU)")
    models = work_dir / "models"
    with LocalHub(hub_root) as hub:
        os.environ["HF_ENDPOINT"] = hub.endpoint  # for anything in this process tree that asks the Hub
        int4 = prepare_model(demo_config(hub.endpoint, models, repo_id=INT4_REPO))
        # No regression gate: on two shared cores vLLM and the client fight for the CPU, and the same
        # commit's peak throughput moved 4x between runs (389 vs 1487 tok/s). The result still says
        # how it compares with the previous demo run (DeployResult.record.compared).
        result = deploy_model(demo_config(hub.endpoint, models, max_regression=None))
        if not kimi:
            return [int4, result, None, None]
        kimi_int4 = prepare_model(demo_config(hub.endpoint, models, repo_id=KIMI_INT4_REPO))
        kimi_result = deploy_model(kimi_demo_config(hub.endpoint, models))
    return [int4, result, kimi_int4, kimi_result]

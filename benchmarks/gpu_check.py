"""The checks that need a GPU, in one short script: the tiny Kimi-K2.5's INT4 variant on one GPU.

What it checks, where a GPU and the real `vllm` package are present (the `gpu` extra):
1. vLLM's INT4 MoE path (Marlin's WNA16 kernels) takes the compressed-tensors pack-quantized
   layout this project validates, in Kimi-K2.5's own form: the tiny Kimi-K2.5's INT4 variant
   (flows/demo/kimi.py: experts quantized, group 32, symmetric, Kimi-K2.5's ignore list inside
   text_config, a vision tower beside it) is fetched from a local Hub, validated, started by the
   deploy flow with its tokenizer's remote code (the demo's own, consented here) and its family's
   kimi_k2 parsers, and answers its probes by completion, by chat in instant mode, the reasoning
   probe thinking and the tool probe with a parsed call: the answer check must pass, as it does for
   the bf16 model on the CPU. `--repo demo/tiny-moe-int4` serves the DeepSeek-shaped one instead.
2. A short sweep (concurrency 1, 4, 16; 5 s levels) with NVML's probe, on one GPU: throughput per
   GPU and tokens per joule where NVML counts energy.
3. The start's phases on a GPU (weights, torch.compile, CUDA graphs), as the server artifact shows them.

It prints the verdict, the answer check's accuracy and the sweep table, and exits 1 when the deploy
fails. Not run by the test suite: the CPU build has no INT4 MoE kernel ("No WNA16 MoE
backend supports the deployment configuration"). The device image lent to some sessions has
PyTorch and NVML but no vLLM, and reaches no package index: there the script says so and exits 2.

    python benchmarks/gpu_check.py [--work-dir gpu-check-work] [--repo demo/tiny-kimi-k2.5-int4]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("gpu-check-work"))
    parser.add_argument("--repo", default=None, help="the INT4 repo to serve (default: the demo's)")
    args = parser.parse_args()
    if importlib.util.find_spec("vllm") is None:
        print("gpu_check: no vllm package here (install the `gpu` extra); nothing checked", file=sys.stderr)
        return 2
    from flows.demo import KIMI_INT4_REPO, build_demo_repos, demo_config
    from flows.demo.hub_server import LocalHub
    from flows.deploy import deploy_model
    from tasks.errors import first_line

    work = args.work_dir.absolute()
    build_demo_repos(work / "hub", say=print)
    with LocalHub(work / "hub") as hub:
        os.environ["HF_ENDPOINT"] = hub.endpoint
        repo = args.repo or KIMI_INT4_REPO
        config = demo_config(hub.endpoint, work / "models", repo_id=repo, max_regression=None,
                             trust_remote_code="kimi" in repo,  # the demo's own tokenizer code
                             enforce_eager=False, cpus=None, kv_cache_memory_bytes=None, env={},
                             concurrency_levels=[1, 4, 16], level_duration_s=5.0, client_cpus=None)
        try:
            result = deploy_model(config)
        except Exception as exc:
            print(f"gpu_check: the deploy failed: {first_line(exc)}", file=sys.stderr)
            return 1
    answers = result.record.answers
    print(f"served {result.prepared.repo_id}@{result.prepared.commit[:12]} on {result.platform}")
    if answers is not None:
        print(f"answer check: {answers.accuracy:.0%} of {len(answers.outputs)} probes right")
    for row in result.results:
        print(f"c={row.concurrency}: {row.output_throughput:,.1f} tok/s, TTFT p50 {row.ttft.median:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

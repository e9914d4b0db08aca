"""The one serving path: a server for the length of a block, swept level by level, then stopped, as
vLLM's own benchmark sweep holds its server in a context manager (benchmarks/sweep/server.py).

Deploy, tune and `rollout bench` all run through it. What differs between them is passed in: how the
server starts (a Prefect task in the deploy flow, plain in tune, nobody's for a server someone else
runs), how one level runs (a task, or plain), and whether the server goes on serving afterwards.
The answer check runs inside the block, between the start and the sweep, where each caller's own
rules apply (the deploy's against the last good deployment, tune's against the model's probes).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass

from tasks.bench.results import LevelResult
from tasks.bench.spec import BenchSpec
from tasks.bench.sweep import knee, single_stream, sweep
from tasks.errors import RolloutError, ServerDied, first_line
from tasks.vllm.log import log_tail
from tasks.vllm.process import ServerHandle, stop_server, vllm_group


@dataclass(frozen=True)
class Sweep:
    """One sweep's levels, and why it ended after the last of them (None: every level ran)."""

    rows: list[LevelResult]
    stop: str | None

    @property
    def knee(self) -> LevelResult | None:
        return knee(self.rows)

    @property
    def single_stream(self) -> LevelResult | None:
        return single_stream(self.rows)


class Serving:
    """`with Serving(start=...) as serving:` the server is started (or adopted: `handle=`, or only an
    address: `base_url=`, for a server this run does not own); `serving.sweep(spec, level)` runs
    its levels; when the block ends the server is stopped with `stop`, or kept where `keep_serving`.
    On any error, Ctrl-C and SIGTERM included, an owned server is stopped at once, not through a
    task: a cancelled flow run may create no more task runs."""

    def __init__(self, *, start: Callable[[], ServerHandle] | None = None, handle: ServerHandle | None = None,
                 base_url: str | None = None, keep_serving: bool = False,
                 stop: Callable[[ServerHandle], None] = stop_server):
        self._start, self.handle, self.keep_serving, self._stop = start, handle, keep_serving, stop
        self.base_url = handle.base_url if handle else base_url

    def __enter__(self) -> Serving:
        if self._start is not None:
            self.handle = self._start()
            self.base_url = self.handle.base_url
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.handle is None:
            return
        died = server_death(self.handle) if exc_type is not None and issubclass(exc_type, Exception) else None
        if exc_type is not None:
            stop_server(self.handle)
        elif not self.keep_serving:
            self._stop(self.handle)
        if died is not None:  # the cause, not its symptom: what failed in the block is said after it
            tail = log_tail(self.handle.log_path)
            last = next((line for line in reversed(tail.splitlines()) if line.strip()), "")
            raise ServerDied(f"the vLLM server at {self.handle.base_url} died during {getattr(exc, 'stage', 'its run')}"
                             f" ({died}): {_said(exc)}" + (f"; its log ends: {last.strip()[:200]}" if last else ""),
                             log_tail=tail) from exc

    def sweep(self, spec: BenchSpec, level: Callable[[int], LevelResult]) -> Sweep:
        """Every level in order until one stops the sweep (`tasks/bench/sweep.py`)."""
        stops: list[str] = []
        rows = sweep(spec, level, stops.append)
        return Sweep(rows=rows, stop=stops[0] if stops else None)


def _said(exc: BaseException) -> str:
    """What the failed step said: its own words for our errors, the class too for anything else."""
    return (str(exc).splitlines() or [""])[0] if isinstance(exc, RolloutError) else first_line(exc)


def server_death(handle: ServerHandle) -> str | None:
    """How the server's process died (its exit code, or the signal that killed it), or None while it
    runs: asked of the process where this run started it, of its process group where it adopted it."""
    if handle.process is not None:
        code = handle.process.poll()
        if code is None:
            return None
        if code < 0:
            return f"killed by signal {-code}, {signal.Signals(-code).name}" if -code in signal.valid_signals() \
                else f"killed by signal {-code}"
        return f"exited with code {code}"
    return None if vllm_group(handle.pgid) else f"its process group {handle.pgid} is gone"

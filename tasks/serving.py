"""The one serving path: a server for the length of a block, swept level by level, then stopped, as
vLLM's own benchmark sweep holds its server in a context manager (benchmarks/sweep/server.py).

Deploy, tune and `rollout bench` all run through it. What differs between them is passed in: how the
server starts (a Prefect task in the deploy flow, plain in tune, nobody's for a server someone else
runs), how one level runs (a task, or plain), and whether the server goes on serving afterwards.
The answer check runs inside the block, between the start and the sweep, where each caller's own
rules apply (the deploy's against the last good deployment, tune's against the model's probes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tasks.bench.results import LevelResult
from tasks.bench.spec import BenchSpec
from tasks.bench.sweep import knee, single_stream, sweep
from tasks.vllm.process import ServerHandle, stop_server


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
        if exc_type is not None:
            stop_server(self.handle)
        elif not self.keep_serving:
            self._stop(self.handle)

    def sweep(self, spec: BenchSpec, level: Callable[[int], LevelResult]) -> Sweep:
        """Every level in order until one stops the sweep (`tasks/bench/sweep.py`)."""
        stops: list[str] = []
        rows = sweep(spec, level, stops.append)
        return Sweep(rows=rows, stop=stops[0] if stops else None)

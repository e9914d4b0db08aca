"""A sweep's level as the code after the load sees it, built by hand: only the figures a test sets matter."""

from __future__ import annotations

from tasks.bench.results import LevelResult


def level_result(concurrency: int, output_throughput: float, completed: int = 1, **measured) -> LevelResult:
    return LevelResult(concurrency=concurrency, max_concurrency=concurrency, requests=completed, completed=completed,
                       failed=0, duration=1.0, output_throughput=output_throughput, **measured)

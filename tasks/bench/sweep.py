"""Levels in order until one stops the sweep, and the knee: the best level within the SLO."""

from __future__ import annotations

from collections.abc import Callable

from tasks.bench.results import LevelResult
from tasks.bench.spec import BenchSpec


def stop_reason(results: list[LevelResult], min_gain: float | None) -> str | None:
    """Why the sweep ends after the last level: every request failed, an SLO broke, or throughput
    stopped growing."""
    if results and results[-1].completed == 0:
        return f"every request failed at concurrency {results[-1].concurrency}: {results[-1].first_error}"
    if results and results[-1].within_slo is False:
        last = results[-1]
        return f"SLO missed at concurrency {last.concurrency} ({last.slo_attainment:.0%} of requests within)"
    if min_gain is None or len(results) < 2:
        return None
    last, before = results[-1], results[-2]
    if last.output_throughput < before.output_throughput:
        return (f"saturated at concurrency {last.concurrency}: output throughput fell to "
                f"{last.output_throughput:,.0f} tok/s from {before.output_throughput:,.0f} at {before.concurrency}")
    if last.output_throughput < before.output_throughput * (1 + min_gain):
        return (f"saturated at concurrency {last.concurrency}: less than {min_gain:.0%} more output "
                f"throughput than at {before.concurrency}")
    return None


def sweep(spec: BenchSpec, level: Callable[[int], LevelResult],
          on_stop: Callable[[str], None] = lambda reason: None) -> list[LevelResult]:
    """Every level in order until one stops the sweep; `level` runs one (a task in a flow, or plain)."""
    results: list[LevelResult] = []
    for concurrency in spec.concurrency_levels:
        results.append(level(concurrency))
        if reason := stop_reason(results, spec.min_throughput_gain):
            on_stop(reason)
            break
    return results


def unusable_level(results: list[LevelResult]) -> LevelResult | None:
    """The first level where every request failed: the server refused the load or died under it.
    A deployment with one is no deployment to keep, however fast its other levels were."""
    return next((r for r in results if r.completed == 0), None)


def knee(results: list[LevelResult]) -> LevelResult | None:
    """The level of best output throughput among those within the SLO (all, when none was given).
    A level too short for a steady state is a knee only when no level had one: its throughput
    includes the fill and drain, so it is no peak to compare a next run with."""
    eligible = [r for r in results if r.within_slo is not False and r.completed > 0]
    steady = [r for r in eligible if r.steady] or eligible
    return max(steady, key=lambda r: r.output_throughput) if steady else None


def single_stream(results: list[LevelResult]) -> LevelResult | None:
    """The level of one stream at a time, where the sweep ran one: the figure a single user feels."""
    return next((r for r in results if r.concurrency == 1), None)

"""The canary on live traffic: after its own checks, the canary takes a share of the fleet's real
requests for a set time, and its latency and errors are compared with the rest of the fleet's.

The latencies are each vLLM's own histograms (/metrics: time to first token, and time per output
token per request), read at the start and the end of the window: the difference is the window's
live traffic alone, as each server measured it. The errors are the router's counters per server.

The rule is the regression gate's: the canary fails where a figure is worse by more than the
threshold (the practical bar) and outside the noise (the two 95% intervals of the mean do not
overlap; a histogram's variance is read from its bucket midpoints, so the interval is approximate),
or where its error rate is above the rest's beyond chance (a one-sided two-proportion z-test at 5%).
A window that ends with too few requests at the canary to judge is held open longer, up to
`EXTENDED_UP_TO` times its length: a verdict needs requests, and quiet traffic or a slow canary
(the one case it is there to catch) gives it fewer. Still too few then is said, not failed.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tasks.fleet.hosts import FleetHost
from tasks.fleet.router import HAProxy, RouterConfig, ServerStats

TTFT = "vllm:time_to_first_token_seconds"
TPOT = "vllm:request_time_per_output_token_seconds"
FIGURES = ((TTFT, "TTFT"), (TPOT, "TPOT"))
MIN_REQUESTS = 20  # at the canary, for a latency to be judged
EXTENDED_UP_TO = 3  # times the router's canary window, while the canary has fewer than MIN_REQUESTS
Z_95 = 1.96
Z_95_ONE_SIDED = 1.645


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram summed over its label sets: cumulative counts by upper bound."""

    bounds: tuple[float, ...]  # ascending, the last is inf
    cumulative: tuple[float, ...]
    total: float  # _sum
    count: float

    def minus(self, earlier: Histogram) -> Histogram:
        if earlier.bounds != self.bounds:  # a restarted server: its counters began again
            return self
        return Histogram(self.bounds, tuple(a - b for a, b in zip(self.cumulative, earlier.cumulative)),
                         self.total - earlier.total, self.count - earlier.count)

    def plus(self, other: Histogram) -> Histogram:
        if not self.bounds:
            return other
        return Histogram(self.bounds, tuple(a + b for a, b in zip(self.cumulative, other.cumulative)),
                         self.total + other.total, self.count + other.count)

    def mean_interval(self) -> tuple[float, tuple[float, float]] | None:
        """The mean (exact: _sum / _count) and an approximate 95% interval for it."""
        if self.count < 2:
            return None
        mean = self.total / self.count
        low_edge, before, second_moment = 0.0, 0.0, 0.0
        for bound, cumulative in zip(self.bounds, self.cumulative):
            in_bucket = cumulative - before
            middle = low_edge if math.isinf(bound) else (low_edge + bound) / 2
            second_moment += in_bucket * (middle - mean) ** 2
            low_edge, before = (low_edge if math.isinf(bound) else bound), cumulative
        half = Z_95 * math.sqrt(second_moment / (self.count - 1)) / math.sqrt(self.count)
        return mean, (mean - half, mean + half)


EMPTY = Histogram((), (), 0.0, 0.0)


def parse_histograms(text: str, names: tuple[str, ...] = (TTFT, TPOT)) -> dict[str, Histogram]:
    """The named histograms of a /metrics page, each summed over engines and models."""
    wanted = {f"{n}{suffix}" for n in names for suffix in ("_bucket", "_sum", "_count")}
    kept = "\n".join(line for line in text.splitlines()
                     if line[:1] not in ("#", "") and line.partition("{")[0].partition(" ")[0] in wanted)
    buckets: dict[str, dict[float, float]] = {n: {} for n in names}
    sums = dict.fromkeys(names, 0.0)
    counts = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(kept + "\n"):
        for sample in family.samples:
            for name in names:
                if sample.name == f"{name}_bucket":
                    bound = float(sample.labels["le"])
                    buckets[name][bound] = buckets[name].get(bound, 0.0) + sample.value
                elif sample.name == f"{name}_sum":
                    sums[name] += sample.value
                elif sample.name == f"{name}_count":
                    counts[name] += sample.value
    return {n: Histogram(tuple(sorted(buckets[n])), tuple(buckets[n][b] for b in sorted(buckets[n])), sums[n],
                         counts[n]) if buckets[n] else EMPTY for n in names}


def read_latency(base_url: str, *, timeout_s: float = 10.0) -> dict[str, Histogram]:
    """A host's latency histograms now; a host that does not answer has none (it is not compared)."""
    try:
        reply = httpx.get(f"{base_url}/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return {}
    return parse_histograms(reply.text) if reply.status_code == 200 else {}


@dataclass(frozen=True)
class CanaryJudgement:
    passed: bool
    findings: tuple[str, ...]  # each figure in words: the canary's beside the rest's, and the verdict
    requests: int  # at the canary, in the window
    extended_to_s: float | None = None  # the window's length where it was held open for requests

    def summary(self) -> str:
        held = (f" (window held open to {self.extended_to_s:.0f} s for requests at the canary)"
                if self.extended_to_s else "")
        return "; ".join(self.findings) + held


@dataclass(frozen=True)
class HostWindow:
    """One host over the observation window: its latency histograms and its router counters, at the
    start and at the end."""

    name: str
    latency_start: dict[str, Histogram]
    latency_end: dict[str, Histogram]
    router_start: ServerStats
    router_end: ServerStats

    def latency(self, name: str) -> Histogram:
        end = self.latency_end.get(name)
        return end.minus(self.latency_start.get(name, EMPTY)) if end else EMPTY

    @property
    def requests(self) -> int:
        return self.router_end.requests - self.router_start.requests

    @property
    def failed(self) -> int:
        return self.router_end.failed - self.router_start.failed


def judge_canary(canary: HostWindow, rest: list[HostWindow], *, max_slowdown: float) -> CanaryJudgement:
    """The canary's window against the rest's, pooled: each latency, then the errors."""
    findings: list[str] = []
    worse = False
    for name, label in FIGURES:
        mine, theirs = canary.latency(name), EMPTY
        for host in rest:
            theirs = theirs.plus(host.latency(name))
        if mine.count < MIN_REQUESTS or theirs.count < MIN_REQUESTS:
            findings.append(f"{label} not judged: {int(mine.count)} requests at the canary, {int(theirs.count)} at "
                            f"the rest (at least {MIN_REQUESTS} each)")
            continue
        (m, m_ci), (t, t_ci) = mine.mean_interval(), theirs.mean_interval()
        change = m / t - 1 if t else 0.0
        beyond, apart = change > max_slowdown, m_ci[0] > t_ci[1]
        why = (f"within {max_slowdown:.0%}" if not beyond else
               f"beyond {max_slowdown:.0%}, " + ("outside the noise" if apart else "but within the noise"))
        findings.append(f"{label} {m * 1000:.1f} ms [{m_ci[0] * 1000:.1f}, {m_ci[1] * 1000:.1f}] vs the rest's "
                        f"{t * 1000:.1f} ms [{t_ci[0] * 1000:.1f}, {t_ci[1] * 1000:.1f}] ({change:+.0%}, {why})")
        worse |= beyond and apart
    c_req, c_fail = canary.requests, canary.failed
    r_req, r_fail = sum(h.requests for h in rest), sum(h.failed for h in rest)
    if c_req and r_req:
        pooled = (c_fail + r_fail) / (c_req + r_req)
        se = math.sqrt(pooled * (1 - pooled) * (1 / c_req + 1 / r_req)) if 0 < pooled < 1 else 0.0
        z = (c_fail / c_req - r_fail / r_req) / se if se else 0.0
        failing = c_fail > 0 and z > Z_95_ONE_SIDED
        findings.append(f"errors {c_fail} of {c_req} vs the rest's {r_fail} of {r_req}"
                        + (" (above the rest's beyond chance)" if failing else ""))
        worse |= failing
    return CanaryJudgement(passed=not worse, findings=tuple(findings), requests=c_req)


def base_url(host: FleetHost) -> str:
    return f"http://{host.address or host.name}:{host.port}"


def _answered(start: ServerStats, end: ServerStats) -> int:
    """The requests a server took between two readings and is no longer busy with."""
    return end.requests - start.requests - end.current


def observe_canary(router: RouterConfig, canary: FleetHost, rest: list[FleetHost], *,
                   poll_s: float = 1.0) -> CanaryJudgement:
    """Give the canary its share of live traffic for the window (longer while it has too few
    requests to judge), then judge it against the hosts the router sends to; its usual weight back
    whatever happens."""
    at = HAProxy(router)
    start = at.stats()
    others = [h for h in rest if h.name in start and start[h.name].in_rotation]
    if not others:
        return CanaryJudgement(True, ("not judged: no other host in rotation to compare with",), 0)
    at.set_weight(canary.name, router.canary_share_percent)
    try:
        hosts = [canary, *others]
        latency_start = {h.name: read_latency(base_url(h)) for h in hosts}
        start = at.stats()  # from the canary's new weight on
        opened = time.monotonic()
        time.sleep(router.canary_window_s)
        end = at.stats()
        while (_answered(start[canary.name], end[canary.name]) < MIN_REQUESTS
               and time.monotonic() - opened < EXTENDED_UP_TO * router.canary_window_s):
            time.sleep(poll_s)
            end = at.stats()
        held_s = time.monotonic() - opened
        latency_end = {h.name: read_latency(base_url(h)) for h in hosts}
    finally:
        at.set_weight(canary.name, 100)
    windows = [HostWindow(h.name, latency_start=latency_start[h.name], latency_end=latency_end[h.name],
                          router_start=start[h.name], router_end=end[h.name]) for h in hosts]
    judged = judge_canary(windows[0], windows[1:], max_slowdown=router.canary_max_slowdown)
    extended = held_s > router.canary_window_s + poll_s
    return dataclasses.replace(judged, extended_to_s=held_s) if extended else judged

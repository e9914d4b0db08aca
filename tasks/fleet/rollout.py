"""What each host of a rollout ended with, and the fleet's table: one row per host, outliers flagged.

A host's outcome is read back from its deploy run (its state, its summary's verdict, its history
record and its fetch table), so the fleet reports exactly what each host's own run page says.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from datetime import datetime, timezone

from tasks.fleet.hosts import FleetHost
from tasks.fleet.router import Traffic
from tasks.history.runs import RunRecord


@dataclass
class HostOutcome:
    host: FleetHost
    wave: int
    serving: bool  # the run completed: the new revision serves on this host
    verdict: str  # the first line of its deploy summary ("Serving: ...", "Rolled back: ...")
    flow_run_id: str | None = None
    record: RunRecord | None = None
    fetched: dict[str, int] = field(default_factory=dict)  # files by where they came from: hub, mirror, cache
    mirror_failures: list[str] = field(default_factory=list)  # "file: why" for each file the mirror failed
    drained_s: float | None = None  # behind a router: how long its requests in flight took to finish
    live: str | None = None  # the canary behind a router: its live traffic against the rest's

    @property
    def status(self) -> str:
        return "serving" if self.serving else self.verdict.split(":")[0].lower() or "failed"


def outliers(outcomes: list[HostOutcome], slowdown: float) -> dict[str, str]:
    """Hosts whose peak (or single stream) is `slowdown` below the median of the hosts that ran the
    same model with the same parallelism on the same GPU type: host name -> why."""
    groups: dict[tuple, list[HostOutcome]] = {}
    for o in outcomes:
        if o.serving and o.record is not None:
            key = (o.record.model, o.record.parallelism, o.host.gpu_type or o.record.gpu)
            groups.setdefault(key, []).append(o)
    flagged = {}
    for (_, _, gpu), members in groups.items():
        if len(members) < 2:
            continue
        for figure, label in (("peak_tok_s", "peak"), ("single_stream_tok_s", "single stream")):
            values = [getattr(m.record, figure) for m in members if getattr(m.record, figure)]
            if len(values) < 2:
                continue
            median = statistics.median(values)
            for m in members:
                value = getattr(m.record, figure)
                if value and value < (1 - slowdown) * median and m.host.name not in flagged:
                    flagged[m.host.name] = (f"outlier: {label} {value:,.1f} tok/s is {1 - value / median:.0%} below "
                                            f"the median of the {len(members)} {gpu} hosts ({median:,.1f})")
    return flagged


def verdict(repo_id: str, commit: str, hosts: list[FleetHost], *, outcomes: list[HostOutcome]) -> str:
    """The rollout in one line, the fleet artifact's first."""
    what = f"{repo_id}@{commit[:12]}"
    done = {o.host.name for o in outcomes}
    untouched = [h.name for h in hosts if h.name not in done]
    failed = [o for o in outcomes if not o.serving]
    if not failed:
        return f"Rolled out: {what} serves on all {len(outcomes)} hosts"
    where = "; ".join(f"{o.host.name} in wave {o.wave}{' (the canary)' if o.wave == 1 else ''}: {_short(o.verdict)}"
                      for o in failed)
    left = f"; untouched, serving what they served: {', '.join(untouched)}" if untouched else ""
    return f"Stopped: {what} failed on {where}{left}"


def _tok_s(value: float | None) -> float | None:
    return round(value, 1) if value is not None else None


def _short(host_verdict: str) -> str:
    """A deploy's verdict up to the stage it failed at ("Rolled back: m@c failed at the vLLM start");
    the error itself is the artifact's, below the table, and the host's run's."""
    return ": ".join(host_verdict.split(": ")[:2])


def fleet_rows(outcomes: list[HostOutcome], hosts: list[FleetHost], *, slowdown: float,
               at_router: dict[str, str] | None = None) -> list[dict]:
    """One row per host, those the rollout never reached included (wave and status say so); behind a
    router, each host's place there at the end ("in rotation", or why it is out)."""
    flags = outliers(outcomes, slowdown)
    by_name = {o.host.name: o for o in outcomes}
    rows = []
    for host in hosts:
        o = by_name.get(host.name)
        r = o.record if o else None
        rows.append({
            "host": host.name, "wave": o.wave if o else None, "flow_run_id": o.flow_run_id if o else None,
            "status": o.status if o else "untouched",
            "router": (at_router or {}).get(host.name, ""),
            "single stream tok/s": _tok_s(r.single_stream_tok_s) if r else None,
            "peak tok/s": _tok_s(r.peak_tok_s) if r else None,
            "down s": f"{r.unavailable_s:.1f}" if r and r.unavailable_s is not None else None,  # the swap's gap
            "vs its last good": (r.compared.split("): ", 1)[-1] if r.compared else "first deployment") if r else "",
            "fetched from": ", ".join(f"{s} {n}" for s, n in o.fetched.items() if n) if o else "",
            "mirror failures": len(o.mirror_failures) if o else 0,
            "outlier": flags.get(host.name, ""),
            "failures": o.mirror_failures if o else [],
            "verdict": o.verdict if o else "",
        })
    return rows


@dataclass(frozen=True)
class FleetReport:
    """A rollout as the fleet artifact and `rollout fleet` tell it: the verdict, a row per host, and
    behind a router what the fleet's clients went through meanwhile."""

    repo_id: str
    commit: str
    verdict: str
    outcomes: list[HostOutcome]
    rows: list[dict]
    mirror: str | None = None  # the canary's, which the hosts after it read
    traffic: Traffic | None = None

    @property
    def rolled_out(self) -> bool:
        return all(o.serving for o in self.outcomes)

    def traffic_lines(self) -> list[str]:
        """The clients' view through the router, for the artifact and the shell."""
        t = self.traffic
        if t is None:
            return []
        out = ", ".join(t.out_of_rotation) if t.out_of_rotation else "none"
        window = " to ".join(datetime.fromtimestamp(at, timezone.utc).strftime("%H:%M:%S.%f")[:-3]
                             for at in (t.since, t.until))
        canary = self.outcomes[0] if self.outcomes and self.outcomes[0].live else None
        live = [f"- **The canary {canary.host.name} on live traffic:** {canary.live}"] if canary else []
        return live + [f"- **Through the router during the rollout** ({window} UTC): {t.requests:,} requests, "
                f"{t.failed:,} failed (5xx answered or cut mid-response)",
                f"- **Router's mean response time:** {t.mean_response_ms_before:,} ms before, "
                f"{t.mean_response_ms_after:,} ms after (its last 1,024 requests)",
                f"- **Out of rotation at the end:** {out}"]

"""A tune run's report: a row per candidate, and the markdown with the winner in its first line.
Plain functions; the Prefect layer publishes them as `tune-<model>` and `tune-table-<model>`."""

from __future__ import annotations

import pandas as pd

from tasks.bench.report import markdown_table, png_data_uri
from tasks.tuning.measure import CandidateResult


def tuning_rows(results: list[CandidateResult]) -> list[dict]:
    """One row per candidate, in the order tried; figures rounded, units in the headers."""
    def num(value: float | None, digits: int = 1) -> float | None:
        return round(value, digits) if value is not None else None

    return [{"candidate": r.name, "status": r.status, "cause": r.cause or "-",
             "single stream tok/s": num(r.single_stream_tok_s), "peak tok/s": num(r.peak_tok_s),
             "knee": r.knee_concurrency, "p99 TTFT ms": num(r.p99_ttft_ms), "startup s": num(r.startup_s),
             "peak tok/s per GPU": num(r.peak_per_gpu), "seconds": num(r.seconds, 2)} for r in results]


def tuning_markdown(repo_id: str, results: list[CandidateResult], best: CandidateResult | None, *, rule: str,
                    chart: bytes | None, promoted: bool) -> tuple[str, str]:
    """(verdict, markdown): the winner in the first line, the Pareto chart, each candidate's outcome
    (a refusal's rule or flag, a failure's cause and log tail)."""
    counts = {s: sum(r.status == s for r in results) for s in ("measured", "refused", "failed", "not measured")}
    tally = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    verdict = (f"Winner: {best.name}: {best.peak_tok_s:,.1f} tok/s peak at c={best.knee_concurrency}, "
               f"{best.single_stream_tok_s or 0:,.1f} single stream" if best
               else "No winner: no candidate was measured")
    lines = [f"# {verdict}", "", f"{repo_id}: {len(results)} candidates ({tally}); winner by {rule}"
             + (" (ties within 2% of the best peak go to the faster single stream)." if rule == "peak" else ".")]
    if promoted and best:
        lines.append("\n**Promoted:** the next deploy of this model on this host serves with the winner's settings.")
    if chart is not None:
        lines += ["", f"![Throughput per GPU against tok/s per user]({png_data_uri(chart)})"]
    lines += ["", markdown_table(pd.DataFrame(tuning_rows(results)))]
    for r in results:
        if r.status in ("refused", "failed"):
            lines += ["", f"**{r.name}**: {r.status} ({r.cause})", "", "```", r.detail[-2000:], "```"]
    return verdict, "\n".join(lines)

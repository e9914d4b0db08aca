"""The answer check's reports as markdown: each probe side by side with the last good answer, and
the files compared with the last good deployment's. Plain functions; the Prefect layer publishes them."""

from __future__ import annotations

from tasks.answers.check import AnswerReport, LoadedAnswers
from tasks.answers.files import FilesComparison


def _under_load(loaded: LoadedAnswers | None) -> str:
    if loaded is None:
        return "not asked (off, or no context length and vocabulary to fill the cache with)"
    if loaded.skipped and not loaded.results:
        return f"not asked: {loaded.skipped}"
    right = sum(r.correct for r in loaded.results)
    usage = f"{loaded.kv_usage:.0%}" if loaded.kv_usage is not None else "an unknown share"
    return (f"{right} of {len(loaded.results)} probes right with the KV cache {usage} full ({loaded.fills} long "
            f"requests)" + (f"; {loaded.skipped}" if loaded.skipped else "")
            + ("; " + "; ".join(loaded.problems) if loaded.problems else ""))


def answers_markdown(report: AnswerReport) -> tuple[str, str]:
    """(verdict, markdown): each probe with the expected answer, the new output and the last good one."""
    def cell(text: str | None) -> str:
        return "-" if text is None else "`" + text.replace("|", "\\|").replace("\n", "\\n")[:60] + "`"

    was = report.last_good
    figures = [f"- **Accuracy:** {report.accuracy:.0%} of {len(report.results)} probes"
               + (f" (last good: {was.accuracy:.0%})" if was else " (first deployment: absolute checks only)"),
               "- **Perplexity of the reference text:** " + (f"{report.perplexity:.3g}" if report.perplexity else
                                                           "not available from this server")
               + (f" (last good: {was.perplexity:.3g})" if was and was.perplexity else ""),
               f"- **Repeated 3-grams:** {report.repeated_ngrams:.0%}"
               + (f" (last good: {was.repeated_ngrams:.0%})" if was else ""),
               f"- **Under load:** {_under_load(report.under_load)}"]
    verdict = "passed" if report.passed else "FAILED: " + "; ".join(report.problems)
    rows = ["| asked by | prompt | expected | new output | last good output | right |", "|---|---|---|---|---|---|"]
    rows += [f"| {'chat' if r.chat else 'completion'} | {cell(r.prompt)} | {cell(r.expected)} | {cell(r.output)} | "
             f"{cell(r.last_good)} | {'yes' if r.correct else 'no'} |" for r in report.results]
    return verdict, "\n".join([f"# Answer check: {verdict}", "", *figures, "", *rows])


def files_markdown(comparison: FilesComparison) -> tuple[str, str]:
    """(verdict, markdown): what changed in the model's files since the last good deployment."""
    verdict = ("FAILED: " + "; ".join(comparison.problems)) if comparison.problems else "passed"
    weights = ("the same weight files" if comparison.same_weights else
               "new weights of the same shapes" if comparison.same_shapes else "new weights, other shapes")
    rows = ["| file | change | verdict |", "|---|---|---|"]
    rows += [f"| {c.file} | {c.change.replace('|', '/')} | {'FAILS: ' + c.why if c.fails else 'named'} |"
             for c in comparison.changes]
    return verdict, "\n".join([f"# Files against the last good deployment: {verdict}", "",
                               f"- **Last good:** {comparison.last_good} ({weights})", "",
                               *(rows if comparison.changes else ["Nothing changed."])])

"""One candidate pruned or measured: the same start, answer check and sweep as a deployment."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from tasks.answers.server_check import check_answers
from tasks.answers.spec import AnswerSpec
from tasks.bench.load import run_level
from tasks.bench.results import LevelResult
from tasks.bench.spec import BenchSpec
from tasks.errors import ServerStartError
from tasks.findings import Violation
from tasks.serving import Serving
from tasks.tuning.space import Candidate
from tasks.vllm.command import build_command, check_arguments
from tasks.vllm.readiness import start_and_wait
from tasks.vllm.settings import ServerConfig, VllmSettings


class CandidateResult(BaseModel):
    """What one candidate came to: refused before launch, failed (its cause classified), or measured."""

    name: str
    settings: VllmSettings
    status: Literal["measured", "refused", "failed", "not measured"]
    cause: str | None = None  # the rule or flag that refused it, or the start failure's cause id
    detail: str = ""  # the refusal's message, or the log tail
    seconds: float = 0.0  # to refuse, or to start, check and measure
    startup_s: float | None = None
    gpus: int = 1
    single_stream_tok_s: float | None = None
    peak_tok_s: float | None = None
    knee_concurrency: int | None = None
    p99_ttft_ms: float | None = None
    accuracy: float | None = None
    levels: list[LevelResult] = []

    @property
    def peak_per_gpu(self) -> float | None:
        return self.peak_tok_s / self.gpus if self.peak_tok_s is not None else None


def refusal(candidate: Candidate, hardware: list[Violation], server: ServerConfig,
            *, cache_dir: Path) -> CandidateResult | None:
    """Refused in milliseconds, before any load: by the hardware rules (memory per GPU, FP8 KV on
    SM12x, more GPUs than the host has), then by the installed vLLM's own parser."""
    started = time.perf_counter()
    if hardware:
        return CandidateResult(name=candidate.name, settings=candidate.settings, status="refused",
                               cause=hardware[0].rule, detail=hardware[0].message,
                               seconds=time.perf_counter() - started)
    try:
        check_arguments(build_command(server, server.port), cache_dir)
    except ServerStartError as err:
        return CandidateResult(name=candidate.name, settings=candidate.settings, status="refused",
                               cause=err.cause, detail=str(err), seconds=time.perf_counter() - started)
    return None


def measure(candidate: Candidate, server: ServerConfig, run_dir: Path, *, timeout_s: float, api_key: str | None,
            answers: AnswerSpec, model_dir: Path, bench: BenchSpec, vocab_size: int | None, gpus: int,
            report: Callable[[str], None] = lambda line: None) -> CandidateResult:
    """Start, answer check, the deployment's sweep, stop: a start or an answer check that fails is a
    result with its cause, and the search goes on."""
    started = time.perf_counter()
    base = dict(name=candidate.name, settings=candidate.settings, gpus=gpus)
    try:
        with Serving(start=lambda: start_and_wait(server, run_dir, timeout_s, api_key=api_key,
                                                  report=report)) as serving:
            handle, accuracy = serving.handle, None
            if answers.enabled:
                checked = check_answers(handle.base_url, server.served_model_name, answers.for_model(model_dir),
                                        api_key=handle.api_key)
                accuracy = checked.accuracy
                if not checked.passed:
                    return CandidateResult(**base, status="failed", cause="answer-check",
                                           detail="; ".join(checked.problems), accuracy=accuracy,
                                           startup_s=handle.startup_s, seconds=time.perf_counter() - started)
            swept = serving.sweep(bench, lambda c: run_level(handle.base_url, server.served_model_name, bench,
                                                             concurrency=c, vocab_size=vocab_size,
                                                             tokenizer=model_dir, api_key=handle.api_key, gpus=gpus))
    except ServerStartError as err:
        return CandidateResult(**base, status="failed", cause=err.cause, detail=err.log_tail[-4000:],
                               seconds=time.perf_counter() - started)
    rows, best, single = swept.rows, swept.knee, swept.single_stream
    return CandidateResult(**base, status="measured", startup_s=handle.startup_s, accuracy=accuracy, levels=rows,
                           single_stream_tok_s=single.output_throughput if single else None,
                           peak_tok_s=best.output_throughput if best else None,
                           knee_concurrency=best.concurrency if best else None,
                           p99_ttft_ms=best.ttft.p99 if best else None, seconds=time.perf_counter() - started)


def winner(results: list[CandidateResult], rule: Literal["peak", "single-stream"] = "peak") -> CandidateResult | None:
    """The best peak throughput within the SLO (the knee is chosen within it), single stream as the
    tie-break within 2%; or the best single stream, where the user serves one stream at a time."""
    measured = [r for r in results if r.status == "measured" and r.peak_tok_s]
    if not measured:
        return None
    if rule == "single-stream":
        return max(measured, key=lambda r: (r.single_stream_tok_s or 0, r.peak_tok_s))
    top = max(r.peak_tok_s for r in measured)
    close = [r for r in measured if r.peak_tok_s >= top * 0.98]
    return max(close, key=lambda r: (r.single_stream_tok_s or 0, r.peak_tok_s))

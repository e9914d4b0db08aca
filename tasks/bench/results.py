"""A level's figures as a typed model whose dump carries `vllm bench serve --save-result` keys.

Code reads `result.ttft.p99` and `result.output_throughput`; the dump (JSON files, tables,
artifacts) flattens each latency to vLLM's names (`p99_ttft_ms`), so our files compare with
theirs key for key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Literal

import numpy as np
from pydantic import BaseModel, model_serializer

from tasks.bench.spec import BenchSpec

LATENCIES = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestRecord:
    """What one request measured; times in seconds."""

    ok: bool
    start_s: float  # since the level started
    e2e_s: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None  # the class, counted per level: HTTP400, ReadTimeout, NoContent
    message: str | None = None  # the server's words for it, first line

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class ServerSamples:
    """/metrics during a level: what vLLM's scheduler saw while our client measured."""

    running: list[float] = field(default_factory=list)
    waiting: list[float] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)
    generated: list[float] = field(default_factory=list)
    prefix_queries: list[float] = field(default_factory=list)  # counters: prompt tokens looked up, found
    prefix_hits: list[float] = field(default_factory=list)


@dataclass
class LevelRun:
    """What one level measured, before any statistics."""

    records: list[RequestRecord]
    duration_s: float
    loop_lag_s: list[float]
    client_cpu_s: float
    server: ServerSamples


class Latency(BaseModel):
    """One latency over a level's requests, in milliseconds; None where nothing was measured."""

    mean: float | None = None
    median: float | None = None
    std: float | None = None
    p90: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, values_s: list[float]) -> Latency:
        if not values_s:
            return cls()
        ms = np.asarray(values_s) * 1000.0
        p90, p99 = np.percentile(ms, (90, 99))
        return cls(mean=ms.mean(), median=np.median(ms), std=ms.std(), p90=p90, p99=p99)


class LevelResult(BaseModel):
    """One concurrency level of a sweep."""

    concurrency: int
    max_concurrency: int
    request_rate: float | Literal["inf"] = "inf"
    burstiness: float = 1.0
    requests: int
    completed: int
    failed: int
    errors: str = ""  # error class=count, for the failed requests
    first_error: str = ""  # the first failure in the server's words
    duration: float
    total_input_tokens: int = 0
    total_output_tokens: int = 0
    request_throughput: float = 0.0
    request_goodput: float | None = None  # None: no SLO given
    slo_attainment: float | None = None
    output_throughput: float
    total_token_throughput: float = 0.0
    ttft: Latency = Latency()
    tpot: Latency = Latency()
    itl: Latency = Latency()
    e2el: Latency = Latency()
    client_loop_lag_p99_ms: float = 0.0
    client_cpu_share: float = 0.0
    server_running_max: float | None = None  # None: the server has no vLLM /metrics
    server_waiting_max: float | None = None
    server_kv_cache_usage_max: float | None = None
    server_output_throughput: float | None = None
    server_prefix_cache_hit_rate: float | None = None  # share of the level's prompt tokens found cached
    within_slo: bool | None = None
    flags: str = ""

    @model_serializer(mode="wrap")
    def _vllm_keys(self, dump) -> dict:
        flat: dict = {}
        for key, value in dump(self).items():
            if key in LATENCIES:
                flat |= {f"{stat}_{key}_ms": v for stat, v in value.items()}
            else:
                flat[key] = value
        return flat


def _delta(counter: list[float]) -> float:
    """A counter's growth over the level (0 when it was not scraped)."""
    return counter[-1] - counter[0] if len(counter) > 1 else 0.0


def _good(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """vLLM's goodput rule: every given SLO met; a one-token request's TPOT counts as 0."""
    measured = {"ttft": record.ttft_s or 0.0, "tpot": record.tpot_s or 0.0, "e2el": record.e2e_s}
    return record.ok and all(measured[k] * 1000.0 <= limit for k, limit in slos_ms.items())


def summarize(concurrency: int, run: LevelRun, spec: BenchSpec) -> LevelResult:
    """One level's figures from its requests, its client watch and its /metrics samples."""
    records, duration = run.records, run.duration_s
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error or "Unknown"] = errors.get(r.error or "Unknown", 0) + 1
    slos = spec.slos_ms
    good = sum(_good(r, slos) for r in records) if slos else None
    lag_p99 = float(np.percentile(run.loop_lag_s, 99)) * 1000.0 if run.loop_lag_s else 0.0
    cpu_share = run.client_cpu_s / duration if duration > 0 else 0.0
    s = run.server
    server_tok_s = _delta(s.generated) / duration if len(s.generated) > 1 and duration > 0 else None
    attainment = good / len(records) if good is not None else None
    within_slo = None if attainment is None else attainment >= spec.slo_attainment
    flags = ", ".join(flag for flag, hit in (
        ("client-limited", lag_p99 > spec.max_loop_lag_ms or cpu_share > 0.9),
        ("queued", bool(s.waiting) and max(s.waiting) > 0),
        ("kv-cache-full", bool(s.kv_usage) and max(s.kv_usage) >= 0.99),
        ("all-failed", not ok),
        ("failures", 0 < len(ok) < len(records)),
        ("slo-missed", within_slo is False),
    ) if hit)
    return LevelResult(
        concurrency=concurrency,
        max_concurrency=concurrency,
        request_rate=spec.request_rate if spec.request_rate is not None else "inf",
        burstiness=spec.burstiness,
        requests=len(records),
        completed=len(ok),
        failed=len(records) - len(ok),
        errors=", ".join(f"{k}={v}" for k, v in sorted(errors.items())),
        first_error=next((r.message or r.error or "" for r in records if not r.ok), ""),
        duration=duration,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration,
        request_goodput=good / duration if good is not None else None,
        slo_attainment=attainment,
        output_throughput=output_tokens / duration,
        total_token_throughput=(input_tokens + output_tokens) / duration,
        ttft=Latency.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=Latency.of([t for r in ok if (t := r.tpot_s) is not None]),
        itl=Latency.of([x for r in ok for x in r.itl_s]),
        e2el=Latency.of([r.e2e_s for r in ok]),
        client_loop_lag_p99_ms=lag_p99,
        client_cpu_share=cpu_share,
        server_running_max=max(s.running) if s.running else None,
        server_waiting_max=max(s.waiting) if s.waiting else None,
        server_kv_cache_usage_max=max(s.kv_usage) if s.kv_usage else None,
        server_output_throughput=server_tok_s,
        server_prefix_cache_hit_rate=_delta(s.prefix_hits) / queried if (queried := _delta(s.prefix_queries)) else None,
        within_slo=within_slo,
        flags=flags,
    )


def level_json(result: LevelResult, run: LevelRun, model: str, spec: BenchSpec) -> dict:
    """The level as `vllm bench serve --save-result` writes it, per-request lists included."""
    return {
        "date": datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if spec.api == "chat" else "openai",
        "model_id": model,
        "num_prompts": len(run.records),
        **result.model_dump(),
        "input_lens": [r.prompt_tokens for r in run.records],
        "output_lens": [r.output_tokens for r in run.records],
        "ttfts": [r.ttft_s or 0.0 for r in run.records],
        "itls": [r.itl_s for r in run.records],
        "latencies": [r.e2e_s for r in run.records],
        "start_times": [r.start_s for r in run.records],
        "errors": [r.error or "" for r in run.records],
    }

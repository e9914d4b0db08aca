"""A level's figures as a typed model whose dump carries `vllm bench serve --save-result` keys.

Code reads `result.ttft.p99` and `result.output_throughput`; the dump (JSON files, tables,
artifacts) flattens each latency to vLLM's names (`p99_ttft_ms`), so our files compare with
theirs key for key. TTFC and token ITL, our precise versions of TTFT and ITL, sit beside them.

A level's figures come from its measurement window, as GuideLLM's and AIPerf's do: the first
`warmup` share of the time requests were being sent is the fill, the last `cooldown` share and
the drain after it are the emptying, and neither is measured. Latencies are those of the requests
sent within the window, throughput the tokens that arrived within it over its length; counts
(requests, completed, total tokens) are the whole level's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Literal

import numpy as np
from pydantic import BaseModel, model_serializer

from tasks.bench.spec import BenchSpec
from tasks.bench.stats import MIN_P99_SAMPLES, quantile_intervals, rate_interval

LATENCIES = ("ttft", "ttfc", "tpot", "itl", "token_itl", "e2el")


@dataclass
class RequestRecord:
    """What one request measured; times in seconds."""

    ok: bool
    start_s: float  # since the level started
    e2e_s: float
    ttft_s: float | None = None  # vLLM's: the first chunk with choices
    itl_s: list[float] = field(default_factory=list)  # vLLM's: one per chunk with choices after the first
    ttfc_s: float | None = None  # the first content
    token_itl_s: list[float] = field(default_factory=list)  # one per output token after the first
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
    sending_s: float  # how long requests were being sent: the level's length, before its drain
    loop_lag_s: list[float]
    client_cpu_s: float
    server: ServerSamples
    gpus: int | None = None  # how many GPUs served the level; None on a CPU host or an unknown server
    energy_j: list[tuple[float, float]] = field(default_factory=list)  # (s from the level's start, GPU joules)


class Latency(BaseModel):
    """One latency over a level's measured requests, in milliseconds, with 95% intervals for its
    median and p99; None where nothing was measured, and p99 None below MIN_P99_SAMPLES values."""

    mean: float | None = None
    median: float | None = None
    std: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None
    samples: int = 0
    median_ci: tuple[float, float] | None = None
    p99_ci: tuple[float, float] | None = None

    @classmethod
    def of(cls, per_request_s: list[list[float]], seed: int = 0, resolution_ms: float = 0.0) -> Latency:
        """From each request's values (one for TTFT, many for ITL), resampled request by request.
        A timestamp is only as sharp as the event loop that takes it: the intervals are widened by
        `resolution_ms`, the client's p90 wake-up lag, added in quadrature."""
        sizes = [len(v) for v in per_request_s]
        if not sum(sizes):
            return cls()
        ms = np.concatenate([np.asarray(v, dtype=np.float64) for v in per_request_s]) * 1000.0
        owners = np.repeat(np.arange(len(sizes)), sizes)
        p90, p99 = np.percentile(ms, (90, 99))
        median_ci, p99_ci = quantile_intervals(ms, owners, len(sizes), quantiles=(0.5, 0.99), seed=seed)
        median, enough = float(np.median(ms)), len(ms) >= MIN_P99_SAMPLES
        return cls(mean=ms.mean(), median=median, std=ms.std(), p90=p90, p99=p99 if enough else None,
                   max=ms.max(), samples=len(ms), median_ci=_widened(median, median_ci, resolution_ms),
                   p99_ci=_widened(p99, p99_ci, resolution_ms) if enough else None)


def _widened(value: float, ci: tuple[float, float], resolution_ms: float) -> tuple[float, float] | None:
    if np.isnan(ci[0]):
        return None
    low, high = value - ci[0], ci[1] - value
    return (value - float(np.hypot(low, resolution_ms)), value + float(np.hypot(high, resolution_ms)))


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
    window_start: float = 0.0  # the measurement window, seconds from the level's start
    window: float = 0.0
    measured: int = 0  # requests sent within the window: the latencies' population
    steady: bool = True  # False: too short for a window, every figure includes the fill and drain
    total_input_tokens: int = 0
    total_output_tokens: int = 0
    request_throughput: float = 0.0
    request_goodput: float | None = None  # None: no SLO given
    slo_attainment: float | None = None
    output_throughput: float
    output_throughput_ci: tuple[float, float] | None = None
    total_token_throughput: float = 0.0
    ttft: Latency = Latency()
    ttfc: Latency = Latency()
    tpot: Latency = Latency()
    itl: Latency = Latency()
    token_itl: Latency = Latency()
    e2el: Latency = Latency()
    client_loop_lag_p99_ms: float = 0.0
    client_cpu_share: float = 0.0
    server_running_max: float | None = None  # None: the server has no vLLM /metrics
    server_waiting_max: float | None = None
    server_kv_cache_usage_max: float | None = None
    server_output_throughput: float | None = None
    server_prefix_cache_hit_rate: float | None = None  # share of the level's prompt tokens found cached
    gpus: int | None = None
    output_throughput_per_gpu: float | None = None
    energy_j: float | None = None  # the GPUs' energy over the measurement window (NVML)
    output_tokens_per_joule: float | None = None
    within_slo: bool | None = None
    flags: str = ""

    @model_serializer(mode="wrap")
    def _vllm_keys(self, dump) -> dict:
        flat: dict = {}
        for key, value in dump(self).items():
            if key in LATENCIES:
                flat |= {_flat_key(stat, key): v for stat, v in value.items()}
            else:
                flat[key] = value
        return flat


def _flat_key(stat: str, latency: str) -> str:
    """vLLM's name for a latency's statistic (`p99_ttft_ms`), and ours beside it (`p99_ttft_ms_ci`)."""
    if stat == "samples":
        return f"{latency}_samples"
    if stat.endswith("_ci"):
        return f"{stat[:-3]}_{latency}_ms_ci"
    return f"{stat}_{latency}_ms"


def _delta(counter: list[float]) -> float:
    """A counter's growth over the level (0 when it was not scraped)."""
    return counter[-1] - counter[0] if len(counter) > 1 else 0.0


def _good(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """vLLM's goodput rule: every given SLO met; a one-token request's TPOT counts as 0."""
    measured = {"ttft": record.ttft_s or 0.0, "tpot": record.tpot_s or 0.0, "e2el": record.e2e_s}
    return record.ok and all(measured[k] * 1000.0 <= limit for k, limit in slos_ms.items())


def measurement_window(run: LevelRun, spec: BenchSpec) -> tuple[float, float] | None:
    """[start, end) in seconds from the level's start, or None where the level was too short to have
    one: shorter than a request's life (the median E2E), as when every request is sent at once, so
    that what it holds is the fill or the drain, not the pace the server keeps."""
    start, end = spec.warmup * run.sending_s, (1 - spec.cooldown) * run.sending_s
    lives = [r.e2e_s for r in run.records if r.ok]
    if lives and end - start >= float(np.median(lives)) and any(r.ok and start <= r.start_s < end for r in run.records):
        return start, end
    return None


def _arrivals(ok: list[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    """When each output token arrived (seconds from the level's start), and what it weighs: one,
    or more where the server did not report usage per chunk and a chunk stood for several."""
    times, weights = [], []
    for r in ok:
        arrived = r.start_s + r.ttfc_s + np.concatenate(([0.0], np.cumsum(r.token_itl_s)))
        times.append(arrived)
        weights.append(np.full(len(arrived), r.output_tokens / len(arrived)))
    if not times:
        return np.zeros(0), np.zeros(0)
    return np.concatenate(times), np.concatenate(weights)


def summarize(concurrency: int, run: LevelRun, spec: BenchSpec) -> LevelResult:
    """One level's figures over its measurement window, from its requests, its client watch and its
    /metrics samples."""
    records, duration = run.records, run.duration_s
    ok = [r for r in records if r.ok]
    window = measurement_window(run, spec)
    start, end = window or (0.0, duration)
    length = end - start
    sent = [r for r in records if start <= r.start_s < end] if window else records
    measured = [r for r in sent if r.ok]
    arrived, weights = _arrivals(ok)
    in_window = (arrived >= start) & (arrived < end) if window else np.ones(len(arrived), dtype=bool)
    output_tokens = float(weights[in_window].sum())  # in the window; the totals are the whole level's
    input_tokens = sum(r.prompt_tokens for r in ok if not window or start <= r.start_s + r.ttfc_s < end)
    finished = sum(1 for r in ok if not window or start <= r.start_s + r.e2e_s < end)
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error or "Unknown"] = errors.get(r.error or "Unknown", 0) + 1
    slos = spec.slos_ms
    good = sum(_good(r, slos) for r in sent) if slos else None  # a failed request misses every SLO
    lag_p99 = float(np.percentile(run.loop_lag_s, 99)) * 1000.0 if run.loop_lag_s else 0.0
    # The timestamps' error floor: nine in ten loop wake-ups come within it. With the median lag
    # instead, ten repeats of one level against a fixed-speed server held each other's medians in
    # 78-80% of the pairs (the medians moved ~1 ms between repeats); with the p90, in 97-100%.
    resolution = float(np.percentile(run.loop_lag_s, 90)) * 1000.0 if run.loop_lag_s else 0.0
    cpu_share = run.client_cpu_s / duration if duration > 0 else 0.0
    s = run.server
    server_tok_s = _delta(s.generated) / duration if len(s.generated) > 1 and duration > 0 else None
    attainment = good / len(sent) if good is not None and sent else None
    within_slo = None if attainment is None else attainment >= spec.slo_attainment
    flags = ", ".join(flag for flag, hit in (
        ("client-limited", lag_p99 > spec.max_loop_lag_ms or cpu_share > 0.9),
        ("queued", bool(s.waiting) and max(s.waiting) > 0),
        ("kv-cache-full", bool(s.kv_usage) and max(s.kv_usage) >= 0.99),
        ("all-failed", not ok),
        ("failures", 0 < len(ok) < len(records)),
        ("slo-missed", within_slo is False),
        ("no-steady-state", bool(ok) and window is None),
    ) if hit)
    seed = spec.seed + concurrency
    energy = None
    if len(run.energy_j) > 1:
        at, joules = zip(*run.energy_j)
        energy = float(np.interp(end, at, joules) - np.interp(start, at, joules))
    throughput_ci = rate_interval(arrived[in_window], weights[in_window], start, end=end) if window else None
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
        window_start=start,
        window=length,
        measured=len(measured),
        steady=window is not None,
        total_input_tokens=sum(r.prompt_tokens for r in ok),
        total_output_tokens=sum(r.output_tokens for r in ok),
        request_throughput=finished / length if length > 0 else 0.0,
        request_goodput=good / length if good is not None and length > 0 else None,
        slo_attainment=attainment,
        output_throughput=output_tokens / length if length > 0 else 0.0,
        output_throughput_ci=throughput_ci,
        total_token_throughput=(input_tokens + output_tokens) / length if length > 0 else 0.0,
        ttft=Latency.of([[r.ttft_s] for r in measured if r.ttft_s is not None], seed, resolution),
        ttfc=Latency.of([[r.ttfc_s] for r in measured if r.ttfc_s is not None], seed, resolution),
        tpot=Latency.of([[t] for r in measured if (t := r.tpot_s) is not None], seed, resolution),
        itl=Latency.of([r.itl_s for r in measured], seed, resolution),
        token_itl=Latency.of([r.token_itl_s for r in measured], seed, resolution),
        e2el=Latency.of([[r.e2e_s] for r in measured], seed, resolution),
        client_loop_lag_p99_ms=lag_p99,
        client_cpu_share=cpu_share,
        server_running_max=max(s.running) if s.running else None,
        server_waiting_max=max(s.waiting) if s.waiting else None,
        server_kv_cache_usage_max=max(s.kv_usage) if s.kv_usage else None,
        server_output_throughput=server_tok_s,
        server_prefix_cache_hit_rate=_delta(s.prefix_hits) / queried if (queried := _delta(s.prefix_queries)) else None,
        gpus=run.gpus,
        output_throughput_per_gpu=output_tokens / length / run.gpus if run.gpus and length > 0 else None,
        energy_j=energy,
        output_tokens_per_joule=output_tokens / energy if energy else None,
        within_slo=within_slo,
        flags=flags,
    )


def level_json(result: LevelResult, run: LevelRun, model: str, *, spec: BenchSpec) -> dict:
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
        "ttfcs": [r.ttfc_s or 0.0 for r in run.records],
        "token_itls": [r.token_itl_s for r in run.records],
        "latencies": [r.e2e_s for r in run.records],
        "start_times": [r.start_s for r in run.records],
        "errors": [r.error or "" for r in run.records],
    }

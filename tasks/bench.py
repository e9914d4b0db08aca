"""Streaming load against an OpenAI-compatible server, measured the way `vllm bench serve` does.

Definitions follow vLLM's serve benchmark so our numbers compare with theirs: TTFT is the time to
the first chunk that carries content, E2E the time to the last one, TPOT = (E2E - TTFT) / (output
- 1) per request, ITL the gaps between content chunks, and token counts come from the server's
usage block, never from counting chunks. Where the server reports usage per chunk (vLLM's
continuous_usage_stats), a chunk that carries k tokens counts as k intervals of a k-th of its gap.

The requests go through the openai client (its request building, auth and errors) over aiohttp,
and the stream is read as raw server-sent events: the client's own per-chunk parsing caps
ingest near 17k tok/s on one core, far below what a loaded server sends. The client watches itself
(event-loop lag, CPU share) and flags a level where it, not the server, was the limit.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

import httpx
import numpy as np
import orjson
from openai import APIStatusError, AsyncOpenAI, DefaultAioHttpClient
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field, field_validator

from tasks.errors import BenchConfigError

PERCENTILES = (90, 99)


class BenchSpec(BaseModel):
    """How to load the server and how far to sweep; the Prefect UI renders this as a form."""

    api: Literal["completions", "chat"] = Field("completions", description="OpenAI endpoint to stream from")
    concurrency_levels: list[int] = Field([1, 2, 4, 8, 16, 32, 64, 128, 256], min_length=1,
                                          description="Requests in flight per level, swept in order")
    min_throughput_gain: float | None = Field(
        0.05, ge=0, description="Stop when a level adds less than this share of throughput; empty: never")
    requests_per_level: int = Field(64, ge=1, description="Requests per level (at least the level's concurrency)")
    request_rate: float | None = Field(None, gt=0, description="Poisson arrivals per second; empty: all at once")
    burstiness: float = Field(1.0, gt=0, description="Gamma shape of arrivals: 1 Poisson, <1 burstier, >1 steadier")
    input_len: int = Field(1024, ge=1, description="Prompt tokens per request")
    output_len: int = Field(256, ge=2, description="Output tokens per request (ignore_eos makes it exact)")
    dataset: Path | None = Field(None, description="JSONL file of {\"prompt\": text} used instead of random prompts")
    seed: int = Field(0, description="Prompt and arrival seed")
    slo_ttft_ms: float | None = Field(None, gt=0, description="Goodput SLO: time to first token")
    slo_tpot_ms: float | None = Field(None, gt=0, description="Goodput SLO: time per output token")
    slo_e2el_ms: float | None = Field(None, gt=0, description="Goodput SLO: end-to-end latency")
    slo_attainment: float = Field(0.99, gt=0, le=1, description="Share of requests within SLO for a level to pass")
    continuous_usage: bool = Field(True, description="Ask for per-chunk usage (vLLM); off for servers that reject it")
    max_loop_lag_ms: float = Field(10.0, gt=0, description="Client event-loop lag (p99) above which a level is flagged")
    request_timeout_s: float = Field(600.0, gt=0, description="Deadline per request")

    @field_validator("concurrency_levels")
    @classmethod
    def _positive_levels(cls, levels: list[int]) -> list[int]:
        if any(c < 1 for c in levels):
            raise ValueError("every concurrency level must be >= 1")
        return sorted(set(levels))

    @property
    def slos_ms(self) -> dict[str, float]:
        slos = {"ttft": self.slo_ttft_ms, "tpot": self.slo_tpot_ms, "e2el": self.slo_e2el_ms}
        return {k: v for k, v in slos.items() if v is not None}


def geometric_levels(max_concurrency: int, factor: int = 2) -> list[int]:
    """1, factor, factor^2, ... up to max_concurrency, which is always the last level."""
    levels, c = [], 1
    while c < max_concurrency:
        levels.append(c)
        c *= factor
    return levels + [max_concurrency]


@dataclass
class RequestRecord:
    ok: bool
    start_s: float  # since the level started
    e2e_s: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def make_prompts(count: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Token-id prompts of exactly input_len tokens, away from the special ids at both vocab ends."""
    rng = np.random.default_rng(seed)
    low, high = min(100, vocab_size // 10), vocab_size - min(1000, vocab_size // 10)
    return rng.integers(low, high, size=(count, input_len)).tolist()


@functools.lru_cache(maxsize=4)
def _tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def level_prompts(spec: BenchSpec, concurrency: int, vocab_size: int | None,
                  tokenizer: str | Path | None) -> list[list[int]] | list[str]:
    """A level's prompts (at least one per slot): the dataset's, or random ids, as text for chat."""
    count, seed = max(spec.requests_per_level, concurrency), spec.seed + concurrency
    if spec.dataset is not None:
        try:
            texts = [json.loads(line)["prompt"] for line in spec.dataset.read_text().splitlines() if line.strip()]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BenchConfigError(f"{spec.dataset}: not JSONL of {{\"prompt\": text}} ({exc})") from exc
        if not texts:
            raise BenchConfigError(f"{spec.dataset}: no prompts")
        return [texts[i % len(texts)] for i in range(count)]
    if spec.api == "completions" and vocab_size is not None:
        return make_prompts(count, spec.input_len, vocab_size, seed)  # token ids: exact input lengths
    if tokenizer is None:
        raise BenchConfigError(f"{spec.api} prompts need the served model's tokenizer"
                               + (" (or its vocab size)" if spec.api == "completions" else "") + ", or a dataset")
    try:
        tok = _tokenizer(str(tokenizer))
    except Exception as exc:  # a tokenizer that needs remote code, a missing file, ...
        raise BenchConfigError(f"tokenizer {tokenizer}: {type(exc).__name__}: {exc}".splitlines()[0]) from exc
    ids = make_prompts(count, spec.input_len, len(tok), seed)
    return [tok.decode(p) for p in ids] if spec.api == "chat" else ids


def arrival_offsets(count: int, rate: float | None, burstiness: float, seed: int) -> np.ndarray:
    """Send times from the level's start: gamma gaps with mean 1/rate, as vLLM's serve benchmark."""
    if rate is None or math.isinf(rate):
        return np.zeros(count)
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count)
    gaps[0] = 0.0
    return np.cumsum(gaps)


_SENT: contextvars.ContextVar[list[float]] = contextvars.ContextVar("sent")


async def _stamp_send(request: httpx.Request) -> None:
    """httpx's request hook, just before the bytes go out: the moment the request is sent."""
    if (stamps := _SENT.get(None)) is not None:
        stamps.append(time.perf_counter())


def _error_class(exc: Exception) -> str:
    if isinstance(exc, APIStatusError):
        return f"HTTP{exc.status_code}"
    return type(exc).__name__


async def _one_request(client: AsyncOpenAI, spec: BenchSpec, model: str, prompt, output_len: int,
                       level_start: float) -> RequestRecord:
    # The body rides in extra_body, past the client's typed transform: it walks every field, and a
    # token-id prompt item by item (7 ms of CPU per 1024-token request), which at 256 streams would
    # make the client the bottleneck. The placeholders satisfy the signatures; extra_body wins.
    options = {"include_usage": True} | ({"continuous_usage_stats": True} if spec.continuous_usage else {})
    body = {"stream_options": options, "temperature": 0.0, "ignore_eos": True, "min_tokens": output_len}
    if spec.api == "chat":
        call = client.chat.completions.with_streaming_response.create(
            model=model, messages=[], stream=True, extra_body=body | {
                "messages": [{"role": "user", "content": prompt}], "max_completion_tokens": output_len})
    else:
        call = client.completions.with_streaming_response.create(
            model=model, prompt="", stream=True, extra_body=body | {"prompt": prompt, "max_tokens": output_len})
    queued = time.perf_counter()
    sent = _SENT.set([])
    try:
        async with call as response:
            stream = _Stream(_SENT.get()[0] if _SENT.get() else queued)
            async for data in response.iter_bytes():
                stream.feed(data, time.perf_counter())
    except Exception as exc:  # every failure is counted by class, none aborts the level
        return RequestRecord(ok=False, start_s=queued - level_start, e2e_s=time.perf_counter() - queued,
                             error=_error_class(exc))
    finally:
        _SENT.reset(sent)
    ok = stream.ttft is not None and stream.output_tokens > 0
    return RequestRecord(ok=ok, start_s=stream.start - level_start, e2e_s=stream.last - stream.start,
                         ttft_s=stream.ttft, itl_s=stream.itl, prompt_tokens=stream.prompt_tokens,
                         output_tokens=stream.output_tokens,
                         error=None if ok else ("NoContent" if stream.ttft is None else "NoUsage"))


class _Stream:
    """One response's server-sent events, timed one network read at a time.

    Per-read, not per-event, bookkeeping: at 256 streams the client handles ~10^6 events a second,
    and every Python statement in this loop is a share of the ceiling benchmarks/client.py measures.
    Events that arrive in one read share its timestamp, so all but the first get a zero gap, as
    in vLLM's benchmark, which stamps each event of a read microseconds apart.
    """

    __slots__ = ("start", "last", "ttft", "itl", "prompt_tokens", "output_tokens", "counted", "pending")

    def __init__(self, start: float):
        self.start = self.last = start
        self.ttft: float | None = None
        self.itl: list[float] = []
        self.prompt_tokens = self.output_tokens = self.counted = 0
        self.pending = b""

    def feed(self, data: bytes, now: float) -> None:
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        events = (self.pending + data).split(b"\n\n")
        self.pending = events.pop()
        first = rest = 0
        for event in events:
            if b"\n" in event:  # several fields in one event: its data lines are the payload
                event = b"data:" + b"".join(line[5:] for line in event.split(b"\n") if line.startswith(b"data:"))
            if not event.startswith(b"data:") or event.endswith(b"[DONE]"):
                continue
            chunk = orjson.loads(event[5:])
            usage = chunk.get("usage")
            if usage:
                self.prompt_tokens = usage.get("prompt_tokens") or self.prompt_tokens
                self.output_tokens = usage.get("completion_tokens") or self.output_tokens
            choices = chunk.get("choices")
            if not choices:
                continue
            if usage:  # per-chunk usage: the chunk carries the tokens the count grew by
                k = self.output_tokens - self.counted
                if k <= 0:
                    continue
            else:  # content, or reasoning, not a role-only or empty chunk
                choice = choices[0]
                text = choice.get("text")
                if text is None and (delta := choice.get("delta")):
                    text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                if not text:
                    continue
                k = 1
            self.counted += k
            if first:
                rest += k
            else:
                first = k
        if not first:
            return
        if self.ttft is None:
            self.ttft = now - self.start
            self.itl += [0.0] * rest
        else:
            self.itl += [(now - self.last) / first] * first + [0.0] * rest
        self.last = now


@dataclass
class ServerSamples:
    """/metrics during a level: what vLLM's scheduler saw while our client measured."""

    running: list[float] = field(default_factory=list)
    waiting: list[float] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)
    generated: list[float] = field(default_factory=list)


def parse_metrics(text: str) -> dict[str, float]:
    """Sums per metric over label sets (engines, models): one server's totals."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


async def _scrape(http: httpx.AsyncClient, url: str, samples: ServerSamples, interval_s: float) -> None:
    while True:
        try:
            response = await http.get(url)
            if response.status_code != 200:
                return  # not a vLLM server: no server-side view
            values = parse_metrics(response.text)
        except (httpx.HTTPError, ValueError):
            return
        samples.running.append(values.get("vllm:num_requests_running", 0.0))
        samples.waiting.append(values.get("vllm:num_requests_waiting", 0.0))
        samples.kv_usage.append(values.get("vllm:kv_cache_usage_perc", values.get("vllm:gpu_cache_usage_perc", 0.0)))
        samples.generated.append(values.get("vllm:generation_tokens_total", 0.0))
        await asyncio.sleep(interval_s)


async def _watch_loop(lags: list[float], interval_s: float = 0.005) -> None:
    """How late the loop wakes a sleeper: a busy client delays every chunk timestamp by as much."""
    while True:
        before = time.perf_counter()
        await asyncio.sleep(interval_s)
        lags.append(time.perf_counter() - before - interval_s)


@dataclass
class LevelRun:
    records: list[RequestRecord]
    duration_s: float
    loop_lag_s: list[float]
    client_cpu_s: float
    server: ServerSamples


async def _run_level(base_url: str, model: str, spec: BenchSpec, concurrency: int, prompts: list,
                     api_key: str | None, scrape_interval_s: float) -> LevelRun:
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key or "EMPTY", max_retries=0,
                         timeout=spec.request_timeout_s, http_client=DefaultAioHttpClient(timeout=spec.request_timeout_s,
                                                                 event_hooks={"request": [_stamp_send]}))
    gate = asyncio.Semaphore(concurrency)
    offsets = arrival_offsets(len(prompts), spec.request_rate, spec.burstiness, spec.seed + concurrency)

    async def bounded(prompt, level_start: float) -> RequestRecord:
        async with gate:
            return await _one_request(client, spec, model, prompt, spec.output_len, level_start)

    async def launch(level_start: float) -> list[RequestRecord]:
        started = []
        for prompt, at in zip(prompts, offsets):
            if (delay := level_start + at - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            started.append(asyncio.create_task(bounded(prompt, level_start)))
            # Yield once: aiohttp writes a request's body from a task of its own, so without this a
            # burst of N builds every request before sending any, and the first waits for all.
            await asyncio.sleep(0)
        return list(await asyncio.gather(*started))

    server, lags = ServerSamples(), []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=5.0, headers=headers) as http:
        try:
            # Warm-up, not measured: one short request per slot opens every pooled connection, so the
            # level's TTFT is the server's, not TCP and task start-up on the first wave.
            await asyncio.gather(*(_one_request(client, spec, model, prompts[0], 2, time.perf_counter())
                                   for _ in range(concurrency)))
            watchers = [asyncio.create_task(_watch_loop(lags)),
                        asyncio.create_task(_scrape(http, f"{base_url}/metrics", server, scrape_interval_s))]
            cpu, start = time.process_time(), time.perf_counter()
            records = await launch(start)
            duration, cpu = time.perf_counter() - start, time.process_time() - cpu
            for watcher in watchers:
                watcher.cancel()
            for outcome in await asyncio.gather(*watchers, return_exceptions=True):
                if not isinstance(outcome, (asyncio.CancelledError, type(None))):
                    raise outcome  # a signal (Prefect's cancellation) that landed in a watcher
            await _scrape_once(http, f"{base_url}/metrics", server)
        finally:
            await client.close()
    return LevelRun(records, duration, lags, cpu, server)


async def _scrape_once(http: httpx.AsyncClient, url: str, samples: ServerSamples) -> None:
    """The counter's value after the last request, so the level's generated tokens are complete."""
    if samples.generated:
        try:
            samples.generated.append(parse_metrics((await http.get(url)).text).get("vllm:generation_tokens_total", 0.0))
        except (httpx.HTTPError, ValueError):
            pass


def _stats_ms(name: str, values_s: list[float]) -> dict[str, float | None]:
    keys = ["mean", "median", "std"] + [f"p{p}" for p in PERCENTILES]
    if not values_s:
        return {f"{k}_{name}_ms": None for k in keys}
    arr = np.asarray(values_s) * 1000.0
    stats = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
             f"std_{name}_ms": float(arr.std())}
    return stats | {f"p{p}_{name}_ms": float(np.percentile(arr, p)) for p in PERCENTILES}


def _good(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """vLLM's goodput rule: every given SLO met; a one-token request's TPOT counts as 0."""
    measured = {"ttft": record.ttft_s or 0.0, "tpot": record.tpot_s or 0.0, "e2el": record.e2e_s}
    return record.ok and all(measured[k] * 1000.0 <= limit for k, limit in slos_ms.items())


def summarize(concurrency: int, run: LevelRun, spec: BenchSpec) -> dict:
    """One level's row, keyed as `vllm bench serve --save-result` where the two overlap."""
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
    server_tok_s = (s.generated[-1] - s.generated[0]) / duration if len(s.generated) > 1 and duration > 0 else None
    row = {
        "concurrency": concurrency,
        "max_concurrency": concurrency,
        "request_rate": spec.request_rate if spec.request_rate is not None else "inf",
        "burstiness": spec.burstiness,
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": ", ".join(f"{k}={v}" for k, v in sorted(errors.items())),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if good is not None else None,
        "slo_attainment": good / len(records) if good is not None else None,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        **_stats_ms("ttft", [r.ttft_s for r in ok if r.ttft_s is not None]),
        **_stats_ms("tpot", [t for r in ok if (t := r.tpot_s) is not None]),
        **_stats_ms("itl", [x for r in ok for x in r.itl_s]),
        **_stats_ms("e2el", [r.e2e_s for r in ok]),
        "client_loop_lag_p99_ms": lag_p99,
        "client_cpu_share": cpu_share,
        "server_running_max": max(s.running) if s.running else None,
        "server_waiting_max": max(s.waiting) if s.waiting else None,
        "server_kv_cache_usage_max": max(s.kv_usage) if s.kv_usage else None,
        "server_output_throughput": server_tok_s,
    }
    row["within_slo"] = None if good is None else row["slo_attainment"] >= spec.slo_attainment
    row["flags"] = ", ".join(flag for flag, hit in (
        ("client-limited", lag_p99 > spec.max_loop_lag_ms or cpu_share > 0.9),
        ("queued", bool(s.waiting) and max(s.waiting) > 0),
        ("kv-cache-full", bool(s.kv_usage) and max(s.kv_usage) >= 0.99),
        ("failures", row["failed"] > 0),
        ("slo-missed", row["within_slo"] is False),
    ) if hit)
    return row


def level_json(row: dict, run: LevelRun, model: str, spec: BenchSpec) -> dict:
    """The level as `vllm bench serve --save-result` writes it, per-request lists included."""
    return {
        "date": datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if spec.api == "chat" else "openai",
        "model_id": model,
        "num_prompts": len(run.records),
        **row,
        "input_lens": [r.prompt_tokens for r in run.records],
        "output_lens": [r.output_tokens for r in run.records],
        "ttfts": [r.ttft_s or 0.0 for r in run.records],
        "itls": [r.itl_s for r in run.records],
        "latencies": [r.e2e_s for r in run.records],
        "start_times": [r.start_s for r in run.records],
        "errors": [r.error or "" for r in run.records],
    }


def _run_async(coro):
    """Run on uvloop where available, and let SIGTERM (Prefect's cancellation) end the level.

    uvloop runs Python signal handlers inside loop callbacks and swallows what they raise, so
    Prefect's SIGTERM handler would be lost mid-level and the runner would SIGKILL the flow, host
    lock and all. In the main thread the loop itself takes SIGTERM: it cancels the level, and once
    the loop is gone the signal is raised again for the handler that was there before.
    """
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    signalled: list[int] = []
    in_main = threading.current_thread() is threading.main_thread()

    async def guarded():
        if not in_main:
            return await coro
        loop, level = asyncio.get_running_loop(), asyncio.current_task()
        loop.add_signal_handler(signal.SIGTERM, lambda: (signalled.append(signal.SIGTERM), level.cancel()))
        try:
            return await coro
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM) if in_main else None
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(guarded())
    finally:
        if in_main:
            if previous is not None:  # remove_signal_handler leaves SIG_DFL behind
                signal.signal(signal.SIGTERM, previous)
            if signalled:
                signal.raise_signal(signal.SIGTERM)


def run_level(base_url: str, model: str, spec: BenchSpec, concurrency: int, vocab_size: int | None = None,
              tokenizer: str | Path | None = None, api_key: str | None = None, results_dir: Path | None = None,
              scrape_interval_s: float = 0.2) -> dict:
    """One level, at most `concurrency` in flight; its JSON goes to results_dir."""
    prompts = level_prompts(spec, concurrency, vocab_size, tokenizer)
    run = _run_async(_run_level(base_url, model, spec, concurrency, prompts, api_key, scrape_interval_s))
    row = summarize(concurrency, run, spec)
    if results_dir is not None:
        results_dir.mkdir(parents=True, exist_ok=True)
        (results_dir / f"level-c{concurrency:04d}.json").write_text(json.dumps(level_json(row, run, model, spec)))
    return row


def stop_reason(rows: list[dict], min_gain: float | None) -> str | None:
    """Why the sweep ends after the last row: an SLO broke, or throughput stopped growing."""
    if rows and rows[-1].get("within_slo") is False:
        return f"SLO missed at concurrency {rows[-1]['concurrency']} ({rows[-1]['slo_attainment']:.0%} of requests within)"
    if min_gain is None or len(rows) < 2:
        return None
    last, before = rows[-1], rows[-2]
    if last["output_throughput"] < before["output_throughput"] * (1 + min_gain):
        return (f"saturated at concurrency {last['concurrency']}: less than {min_gain:.0%} more output "
                f"throughput than at {before['concurrency']}")
    return None


def sweep(spec: BenchSpec, level: Callable[[int], dict], on_stop: Callable[[str], None] = lambda reason: None
          ) -> list[dict]:
    """Every level in order until one stops the sweep; `level` runs one (a task in a flow, or plain)."""
    rows: list[dict] = []
    for concurrency in spec.concurrency_levels:
        rows.append(level(concurrency))
        if reason := stop_reason(rows, spec.min_throughput_gain):
            on_stop(reason)
            break
    return rows


def knee(rows: list[dict]) -> dict | None:
    """The level of best output throughput among those within the SLO (all, when none was given)."""
    eligible = [r for r in rows if r.get("within_slo") is not False and r["completed"] > 0]
    return max(eligible, key=lambda r: r["output_throughput"]) if eligible else None

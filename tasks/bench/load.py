"""One level: requests at a set concurrency (or arrival rate), the client watching itself.

The client watches its own event-loop lag and CPU share and flags a level where it, not the
server, was the limit; /metrics is sampled beside the load for the server's side of the story.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
from openai import AsyncOpenAI, DefaultAioHttpClient

from tasks.bench.client import one_request, stamp_send
from tasks.bench.metrics import reset_prefix_cache, scrape, scrape_once
from tasks.bench.prompts import arrival_times, level_prompts
from tasks.bench.results import LevelResult, LevelRun, RequestRecord, ServerSamples, level_json, summarize
from tasks.bench.spec import BenchSpec
from tasks.cpus import parse_cpus
from tasks.errors import BenchConfigError


async def _watch_loop(lags: list[float], interval_s: float = 0.005) -> None:
    """How late the loop wakes a sleeper: a busy client delays every chunk timestamp by as much."""
    while True:
        before = time.perf_counter()
        await asyncio.sleep(interval_s)
        lags.append(time.perf_counter() - before - interval_s)


def _client(base_url: str, spec: BenchSpec, api_key: str | None) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key or "EMPTY", max_retries=0,
                       timeout=spec.request_timeout_s,
                       http_client=DefaultAioHttpClient(timeout=spec.request_timeout_s,
                                                        event_hooks={"request": [stamp_send]}))


async def _watch_energy(read: Callable[[], float], samples: list[tuple[float, float]], start: float,
                        interval_s: float) -> None:
    """The GPUs' energy counter through the level, so the window's share can be read off it."""
    while True:
        samples.append((time.perf_counter() - start, read()))
        await asyncio.sleep(interval_s)


async def _run_level(base_url: str, model: str, spec: BenchSpec, *, concurrency: int, prompts: Iterator,
                     api_key: str | None, scrape_interval_s: float, energy: Callable[[], float] | None,
                     gpus: int | None) -> LevelRun:
    client = _client(base_url, spec, api_key)
    warmup = next(prompts)
    gate = asyncio.Semaphore(concurrency)
    arrivals = arrival_times(spec.request_rate, spec.burstiness, (spec.seed, concurrency))
    limit = max(spec.requests_per_level, concurrency) if spec.requests_per_level else None

    async def measured(prompt, level_start: float) -> RequestRecord:
        try:
            return await one_request(client, spec, model, prompt=prompt, output_len=spec.output_len,
                                     level_start=level_start)
        finally:
            gate.release()

    async def launch(level_start: float) -> tuple[list[RequestRecord], float]:
        """Send until the level's time or count is reached, a request whenever a slot is free (and
        its arrival time has come), then let the ones in flight finish: the drain."""
        deadline = level_start + (spec.level_duration_s or math.inf)
        started = []
        for prompt, at in zip(itertools.islice(prompts, limit), arrivals):
            if (delay := min(level_start + at, deadline) - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            left = deadline - time.perf_counter()
            try:
                await asyncio.wait_for(gate.acquire(), None if math.isinf(left) else max(left, 0.0))
            except TimeoutError:
                break
            started.append(asyncio.create_task(measured(prompt, level_start)))
            # Yield once: aiohttp writes a request's body from a task of its own, so without this a
            # burst of N builds every request before sending any, and the first waits for all.
            await asyncio.sleep(0)
        sending = min(time.perf_counter(), deadline) - level_start
        return list(await asyncio.gather(*started)), sending

    server, lags, joules = ServerSamples(), [], []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=5.0, headers=headers) as http:
        try:
            # Warm-up, not measured: one short request per slot opens every pooled connection, so the
            # level's TTFT is the server's, not TCP and task start-up on the first wave. It sends a
            # prompt of its own, after a prefix-cache reset where the server allows one.
            await reset_prefix_cache(http, base_url)
            await asyncio.gather(*(one_request(client, spec, model, prompt=warmup, output_len=2,
                                               level_start=time.perf_counter())
                                   for _ in range(concurrency)))
            watchers = [asyncio.create_task(_watch_loop(lags)),
                        asyncio.create_task(scrape(http, f"{base_url}/metrics", server, interval_s=scrape_interval_s))]
            cpu, start = time.process_time(), time.perf_counter()
            if energy is not None:
                watchers.append(asyncio.create_task(_watch_energy(energy, joules, start, scrape_interval_s)))
            records, sending = await launch(start)
            duration, cpu = time.perf_counter() - start, time.process_time() - cpu
            for watcher in watchers:
                watcher.cancel()
            for outcome in await asyncio.gather(*watchers, return_exceptions=True):
                if not isinstance(outcome, (asyncio.CancelledError, type(None))):
                    raise outcome  # a signal (Prefect's cancellation) that landed in a watcher
            await scrape_once(http, f"{base_url}/metrics", server)
            if energy is not None:
                joules.append((time.perf_counter() - start, energy()))
        finally:
            await client.close()
    return LevelRun(records, duration, sending_s=sending, loop_lag_s=lags, client_cpu_s=cpu, server=server, gpus=gpus,
                    energy_j=joules)


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


@contextlib.contextmanager
def _pinned(cpus: str | None) -> Iterator[None]:
    """This thread, the level's event loop, on `cpus` for the level: on a CPU host the client and
    the server then do not take turns on one core, which would make both the client's timestamps
    and the server's pace the scheduler's."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, parse_cpus(cpus))  # pid 0: the calling thread only
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def run_level(base_url: str, model: str, spec: BenchSpec, *, concurrency: int, vocab_size: int | None = None,
              tokenizer: str | Path | None = None, api_key: str | None = None, results_dir: Path | None = None,
              scrape_interval_s: float = 0.2, repeat: int = 0, energy: Callable[[], float] | None = None,
              gpus: int | None = None) -> LevelResult:
    """One level, at most `concurrency` in flight; its JSON goes to results_dir. A repeat of a level
    sends prompts of its own. With `energy` (a reader of the serving GPUs' joules) the level reports
    output tokens per joule, and with `gpus` its throughput per GPU."""
    prompts = level_prompts(spec, concurrency, vocab_size, tokenizer=tokenizer, repeat=repeat)
    with _pinned(spec.client_cpus):
        run = _run_async(_run_level(base_url, model, spec, concurrency=concurrency, prompts=prompts, api_key=api_key,
                                    scrape_interval_s=scrape_interval_s, energy=energy, gpus=gpus))
    result = summarize(concurrency, run, spec)
    if results_dir is not None:
        results_dir.mkdir(parents=True, exist_ok=True)
        level_file = results_dir / f"level-c{concurrency:04d}.json"
        level_file.write_text(json.dumps(level_json(result, run, model, spec=spec)))
    return result


def probe_prompts(base_url: str, model: str, spec: BenchSpec, *, vocab_size: int | None = None,
                  tokenizer: str | Path | None = None, api_key: str | None = None) -> BenchSpec:
    """The spec with the prompt form the server takes: token ids where it takes them (exact
    lengths), else text. One short request each; a server that refuses both is a BenchConfigError
    in its own words, before any level runs."""

    async def one(candidate: BenchSpec) -> RequestRecord:
        client = _client(base_url, candidate, api_key)
        try:  # the warm-up's prompt: no measured request then finds the probe's in the prefix cache
            prompt = next(level_prompts(candidate, 1, vocab_size, tokenizer=tokenizer))
            return await one_request(client, candidate, model, prompt=prompt, output_len=2,
                                     level_start=time.perf_counter())
        finally:
            await client.close()

    tried = [spec] + ([spec.model_copy(update={"token_id_prompts": False})]
                      if spec.token_id_prompts and spec.api == "completions" and vocab_size is not None else [])
    refusals = []
    for candidate in tried:
        record = _run_async(one(candidate))
        if record.ok:
            return candidate
        refusals.append(record.message or record.error or "no output")
    raise BenchConfigError(f"{base_url} refuses the benchmark's requests: {refusals[-1]}"
                           + (f" (token-id prompts: {refusals[0]})" if len(refusals) > 1 else ""))

"""Streaming load against an OpenAI-compatible server, measured the way `vllm bench serve` does.

Definitions follow vLLM's serve benchmark so our numbers compare with theirs: TTFT is the time to
the first streamed chunk, ITL the gaps between later chunks, TPOT = (E2E - TTFT) / (output - 1) per
request, and token counts come from the server's usage block, never from counting chunks.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import numpy as np
from openai import AsyncOpenAI
from prefect import task
from prefect.cache_policies import NO_CACHE


@dataclass
class RequestRecord:
    ok: bool
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
    rng = random.Random(seed)
    low, high = min(100, vocab_size // 10), vocab_size - min(1000, vocab_size // 10)
    return [[rng.randrange(low, high) for _ in range(input_len)] for _ in range(count)]


async def _one_request(client: AsyncOpenAI, model: str, prompt: list[int], output_len: int) -> RequestRecord:
    start = time.perf_counter()
    ttft, last, itl = None, start, []
    prompt_tokens = output_tokens = 0
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=output_len,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "min_tokens": output_len},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                if ttft is None:
                    ttft = now - start
                else:
                    itl.append(now - last)
                last = now
            if chunk.usage:
                prompt_tokens = chunk.usage.prompt_tokens
                output_tokens = chunk.usage.completion_tokens
    except Exception as exc:  # every failure is counted by class, none aborts the level
        return RequestRecord(ok=False, e2e_s=time.perf_counter() - start, error=type(exc).__name__)
    return RequestRecord(
        ok=ttft is not None and output_tokens > 0,
        e2e_s=time.perf_counter() - start,
        ttft_s=ttft,
        itl_s=itl,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        error=None if output_tokens else "NoUsage",
    )


async def _run_level(base_url: str, model: str, concurrency: int, prompts: list[list[int]], output_len: int,
                     timeout_s: float, api_key: str | None) -> tuple[list[RequestRecord], float]:
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key or "EMPTY", max_retries=0, timeout=timeout_s)
    gate = asyncio.Semaphore(concurrency)

    async def bounded(prompt: list[int]) -> RequestRecord:
        async with gate:
            return await _one_request(client, model, prompt, output_len)

    try:
        # Warm-up, not measured: one short request per slot opens every pooled connection, so the
        # level's TTFT is the server's, not TCP and thread start-up on the first wave.
        await asyncio.gather(*(_one_request(client, model, prompts[0], 2) for _ in range(concurrency)))
        start = time.perf_counter()
        records = await asyncio.gather(*(bounded(p) for p in prompts))
        return list(records), time.perf_counter() - start
    finally:
        await client.close()


def _stats_ms(prefix: str, values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {f"{prefix}_{k}_ms": None for k in ("mean", "median", "p99")}
    arr = np.asarray(values_s) * 1000.0
    return {
        f"{prefix}_mean_ms": float(arr.mean()),
        f"{prefix}_median_ms": float(np.median(arr)),
        f"{prefix}_p99_ms": float(np.percentile(arr, 99)),
    }


def summarize(concurrency: int, records: list[RequestRecord], duration_s: float) -> dict:
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    total_tokens = output_tokens + sum(r.prompt_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error or "Unknown"] = errors.get(r.error or "Unknown", 0) + 1
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": ", ".join(f"{k}={v}" for k, v in sorted(errors.items())),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": total_tokens / duration_s,
        "total_output_tokens": output_tokens,
        **_stats_ms("ttft", [r.ttft_s for r in ok if r.ttft_s is not None]),
        **_stats_ms("tpot", [t for r in ok if (t := r.tpot_s) is not None]),
        **_stats_ms("itl", [x for r in ok for x in r.itl_s]),
        **_stats_ms("e2el", [r.e2e_s for r in ok]),
    }


def saturated(rows: list[dict], min_gain: float | None) -> bool:
    """True once the last level added less than min_gain of output throughput over the one before."""
    if min_gain is None or len(rows) < 2:
        return False
    return rows[-1]["output_throughput"] < rows[-2]["output_throughput"] * (1 + min_gain)


def run_level(base_url: str, model: str, concurrency: int, num_requests: int, input_len: int, output_len: int,
              vocab_size: int, seed: int = 0, timeout_s: float = 600.0, api_key: str | None = None) -> dict:
    """One concurrency level: num_requests requests, at most `concurrency` in flight."""
    prompts = make_prompts(num_requests, input_len, vocab_size, seed + concurrency)
    records, duration = asyncio.run(_run_level(base_url, model, concurrency, prompts, output_len, timeout_s, api_key))
    return summarize(concurrency, records, duration)


@task(name="bench-level", task_run_name="bench c={concurrency}", tags=["bench"], cache_policy=NO_CACHE)
def bench_level(base_url: str, model: str, concurrency: int, num_requests: int, input_len: int, output_len: int,
                vocab_size: int, seed: int = 0, api_key: str | None = None) -> dict:
    return run_level(base_url, model, concurrency, num_requests, input_len, output_len, vocab_size, seed,
                     api_key=api_key)

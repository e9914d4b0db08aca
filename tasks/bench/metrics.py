"""vLLM's /metrics during a level: what the server's scheduler saw while the client measured."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tasks.bench.results import ServerSamples


def parse_metrics(text: str) -> dict[str, float]:
    """Sums per metric over label sets (engines, models): one server's totals."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


async def scrape(http: httpx.AsyncClient, url: str, samples: ServerSamples, interval_s: float) -> None:
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
        _counters(values, samples)
        await asyncio.sleep(interval_s)


def _counters(values: dict[str, float], samples: ServerSamples) -> None:
    samples.generated.append(values.get("vllm:generation_tokens_total", 0.0))
    samples.prefix_queries.append(values.get("vllm:prefix_cache_queries_total", 0.0))
    samples.prefix_hits.append(values.get("vllm:prefix_cache_hits_total", 0.0))


async def scrape_once(http: httpx.AsyncClient, url: str, samples: ServerSamples) -> None:
    """The counters after the last request, so the level's tokens and cache lookups are complete."""
    if samples.generated:
        try:
            _counters(parse_metrics((await http.get(url)).text), samples)
        except (httpx.HTTPError, ValueError):
            pass


async def reset_prefix_cache(http: httpx.AsyncClient, base_url: str) -> bool:
    """vLLM's POST /reset_prefix_cache (served with VLLM_SERVER_DEV_MODE=1); elsewhere a no-op."""
    try:
        return (await http.post(f"{base_url}/reset_prefix_cache")).status_code == 200
    except httpx.HTTPError:
        return False

"""One streamed request, timed the way `vllm bench serve` times it.

Under vLLM's key names the definitions are vLLM's serve benchmark's, so our numbers compare with
theirs: TTFT is the time to the first chunk with `choices` (a chat stream's role-only chunk
counts), E2E the time to the last one, TPOT = (E2E - TTFT) / (output - 1) per request, and ITL one
interval per such chunk, however many tokens it carries. Beside them, under names of their own,
the precise versions: TTFC, the time to the first content, and token ITL, where a chunk of k tokens
(per-chunk usage, vLLM's continuous_usage_stats) counts as k intervals of a k-th of its gap. Token
counts come from the server's usage block, never from counting chunks.

The request goes through the openai client (its request building, auth and errors) over aiohttp,
and the stream is read as raw server-sent events: the client's own per-chunk parsing caps
ingest near 17k tok/s on one core, far below what a loaded server sends.
"""

from __future__ import annotations

import contextvars
import time

import httpx
import orjson
from openai import APIStatusError, AsyncOpenAI

from tasks.bench.results import RequestRecord
from tasks.bench.spec import BenchSpec

_SENT: contextvars.ContextVar[list[float]] = contextvars.ContextVar("sent")


async def stamp_send(request: httpx.Request) -> None:
    """httpx's request hook, just before the bytes go out: the moment the request is sent."""
    if (stamps := _SENT.get(None)) is not None:
        stamps.append(time.perf_counter())


def _error_class(exc: Exception) -> str:
    if isinstance(exc, APIStatusError):
        return f"HTTP{exc.status_code}"
    return type(exc).__name__


def _error_message(exc: Exception) -> str:
    """The server's own words, first line: what a user needs to see when every request fails."""
    text = str(exc)
    if isinstance(exc, APIStatusError):  # OpenAI's error body, {"error": {"message": ...}}, where it has one
        error = exc.body.get("error", exc.body) if isinstance(exc.body, dict) else None
        text = error.get("message") if isinstance(error, dict) and error.get("message") else exc.message
    return f"{_error_class(exc)}: {(text or type(exc).__name__).splitlines()[0][:300]}"


async def one_request(client: AsyncOpenAI, spec: BenchSpec, model: str, *, prompt, output_len: int,
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
                             error=_error_class(exc), message=_error_message(exc))
    finally:
        _SENT.reset(sent)
    return stream.record(level_start)


class _Stream:
    """One response's server-sent events, timed one network read at a time.

    Per-read, not per-event, bookkeeping: at 256 streams the client handles ~10^6 events a second,
    and every Python statement in this loop is a share of the ceiling benchmarks/client.py measures.
    A read is kept as (time, chunks with choices, tokens of its first content chunk, tokens); the
    intervals are worked out once, when the stream ends. Events that arrive in one read share its
    timestamp, so all but the first get a zero gap, as in vLLM's benchmark, which stamps each event
    of a read microseconds apart.
    """

    __slots__ = ("start", "reads", "prompt_tokens", "output_tokens", "counted", "pending")

    def __init__(self, start: float):
        self.start = start
        self.reads: list[tuple[float, int, int, int]] = []
        self.prompt_tokens = self.output_tokens = self.counted = 0
        self.pending = b""

    def feed(self, data: bytes, now: float) -> None:
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        events = (self.pending + data).split(b"\n\n")
        self.pending = events.pop()
        chunks = first = tokens = 0
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
            chunks += 1
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
            tokens += k
            if not first:
                first = k
        if chunks:
            self.reads.append((now, chunks, first, tokens))

    def record(self, level_start: float) -> RequestRecord:
        """The request's figures in both definitions: vLLM's (TTFT at the first chunk with choices,
        one ITL per such chunk) and ours (TTFC at the first content, one ITL per token: a chunk of k
        tokens is k intervals of a k-th of its gap)."""
        start, ttft, ttfc = self.start, None, None
        itl: list[float] = []
        token_itl: list[float] = []
        last_chunk = last_content = start
        for now, chunks, first, tokens in self.reads:
            if ttft is None:
                ttft = now - start
                itl += [0.0] * (chunks - 1)
            else:
                itl += [now - last_chunk] + [0.0] * (chunks - 1)
            last_chunk = now
            if not tokens:
                continue
            if ttfc is None:
                ttfc = now - start
                token_itl += [0.0] * (tokens - 1)
            else:
                token_itl += [(now - last_content) / first] * first + [0.0] * (tokens - first)
            last_content = now
        ok = ttfc is not None and self.output_tokens > 0
        return RequestRecord(ok=ok, start_s=start - level_start, e2e_s=last_chunk - start, ttft_s=ttft, ttfc_s=ttfc,
                             itl_s=itl, token_itl_s=token_itl, prompt_tokens=self.prompt_tokens,
                             output_tokens=self.output_tokens,
                             error=None if ok else ("NoContent" if ttfc is None else "NoUsage"))

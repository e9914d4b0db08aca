"""An OpenAI-compatible streaming server whose timings, batching and queueing are set by the caller.

The benchmark's definitions are checked against it: it waits ttft_s before the first content chunk
and itl_s per token after (deadlines from the request's start, so sleep jitter does not
accumulate), puts tokens_per_chunk tokens in each chunk, and runs at most `slots` requests at once,
the rest wait, as a server's scheduler queue does, and /metrics reports both in vLLM's names. Chat
streams open with a role-only chunk, as vLLM's do, which no honest TTFT counts. With itl_s 0 it
sends as fast as it can (events_per_write events per write), to find a client's ingest ceiling.
With `rejects` it refuses, as some OpenAI-compatible servers do, completions prompts given as token
ids ("token-ids"), or every generation request ("all"), with a 400 in OpenAI's error format. It keeps
a prefix cache of whole prompts, counted in vLLM's metric names, and empties it on POST
/reset_prefix_cache unless `resets` is off (vLLM serves that only in its dev mode).

A raw ASGI app on uvicorn in a child process: nothing between the socket and the loop but what the
test asks for, and no share of the measuring client's interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import uvicorn

from tasks.cpus import parse_cpus


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class StreamingServer:
    def __init__(self, ttft_s: float = 0.0, itl_s: float = 0.0, tokens_per_chunk: int = 1,
                 slots: int | None = None, events_per_write: int = 1, port: int = 0, rejects: str | None = None,
                 resets: bool = True, cpus: str | None = None, counting: bool = False,
                 degenerate_above: float | None = None, parsers: str | None = None):
        self.ttft_s, self.itl_s, self.tokens_per_chunk = ttft_s, itl_s, tokens_per_chunk
        self.cpus = cpus  # the server's cores, apart from the client's as the demo keeps vLLM's
        self.rejects, self.resets = rejects, resets
        # Whole (non-streamed) answers count on from the prompt's last number, as the demo model does,
        # and turn to "!!!!" while the KV cache (running / slots) is at least `degenerate_above` full.
        self.counting, self.degenerate_above = counting, degenerate_above
        # Chat with tools, or a question to reason about: "parsed" answers as vLLM does with the right
        # tool-call and reasoning parsers, "raw" leaves the model's markup in the content (a wrong one).
        self.parsers = parsers
        self.cached: set[str] = set()
        self.prefix_queries = self.prefix_hits = 0
        self.events_per_write = events_per_write
        self.slots = slots
        self._gate = asyncio.Semaphore(slots) if slots else None
        self.running = self.waiting = 0
        self.generated = 0
        if not port:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"

    async def app(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        if path == "/metrics":
            await self._plain(send, self._metrics().encode())
        elif path == "/reset_prefix_cache" and self.resets:
            self.cached.clear()
            await self._plain(send, b"")
        elif path == "/health":  # as vLLM's: 200 while it serves (a router's health check asks here)
            await self._plain(send, b"")
        elif path == "/v1/models":
            await self._plain(send, json.dumps({"object": "list", "data": [{"id": "fake", "object": "model"}]}).encode())
        elif path in ("/v1/completions", "/v1/chat/completions"):
            request = json.loads(body)
            if self.rejects == "all" or (self.rejects == "token-ids" and not isinstance(request.get("prompt", ""), str)):
                error = {"message": "this server takes only text: 'prompt' must be a string" if self.rejects != "all"
                         else "model 'fake' is overloaded, try again later", "type": "invalid_request_error",
                         "param": "prompt", "code": None}
                await self._plain(send, json.dumps({"error": error}).encode(), status=400)
                return
            if not request.get("stream"):  # one JSON body, as the answer check asks for
                await self._whole(send, request, chat=path.endswith("chat/completions"))
                return
            await self._stream(send, request, chat=path.endswith("chat/completions"))
        else:
            await self._plain(send, b"not found", status=404)

    @staticmethod
    async def _plain(send, data: bytes, status: int = 200) -> None:
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": data})

    def _metrics(self) -> str:
        labels = '{engine="0",model_name="fake"}'
        # A slot holds one request of up to 1024 tokens: the cache's size in vLLM's info gauge.
        info = (f'vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="{self.slots * 64}"}} 1.0\n'
                if self.slots else "")
        return info + "".join([
            "# TYPE vllm:num_requests_running gauge\n", f"vllm:num_requests_running{labels} {self.running}\n",
            "# TYPE vllm:num_requests_waiting gauge\n", f"vllm:num_requests_waiting{labels} {self.waiting}\n",
            "# TYPE vllm:kv_cache_usage_perc gauge\n",
            f"vllm:kv_cache_usage_perc{labels} {self.running / self.slots if self.slots else 0.0}\n",
            "# TYPE vllm:generation_tokens counter\n", f"vllm:generation_tokens_total{labels} {self.generated}\n",
            "# TYPE vllm:prefix_cache_queries counter\n", f"vllm:prefix_cache_queries_total{labels} {self.prefix_queries}\n",
            "# TYPE vllm:prefix_cache_hits counter\n", f"vllm:prefix_cache_hits_total{labels} {self.prefix_hits}\n",
        ])

    async def _whole(self, send, body: dict, chat: bool) -> None:
        """The same tokens, " t" each, as one response: what a stream stuck on one token says."""
        n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        await asyncio.sleep(self.ttft_s + n * self.itl_s)
        text = " t" * n
        numbers = [int(w) for w in str(body.get("prompt") or body.get("messages", [{}])[-1].get("content", "")).split()
                   if w.isdigit()]
        if self.counting and numbers:
            text = "".join(f" {numbers[-1] + k}" for k in range(1, n + 1))
        if self.degenerate_above is not None and self.slots and self.running / self.slots >= self.degenerate_above:
            text = "!" * n
        message = {"role": "assistant", "content": text}
        if chat and self.parsers:
            message = self._parsed(body) if self.parsers == "parsed" else {"role": "assistant",
                                                                            "content": self._raw(body)}
        choice = ({"index": 0, "message": message, "finish_reason": "length"} if chat
                  else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"})
        reply = {"id": "x", "object": "chat.completion" if chat else "text_completion", "created": 0,
                 "model": body["model"], "choices": [choice],
                 "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}}
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(reply).encode()})

    @staticmethod
    def _parsed(body: dict) -> dict:
        if body.get("tools"):
            return {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_0", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]}
        return {"role": "assistant", "content": "42", "reasoning": "17 + 25: 17 + 20 is 37, and 5 more is 42."}

    @staticmethod
    def _raw(body: dict) -> str:
        """Kimi-K2's own markup, as a server without (or with the wrong) parser passes it through."""
        if body.get("tools"):
            return ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                    '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')
        return "<think>17 + 25: 17 + 20 is 37, and 5 more is 42.</think>42"

    async def _stream(self, send, body: dict, chat: bool) -> None:
        self.waiting += 1
        if self._gate:
            await self._gate.acquire()
        self.waiting -= 1
        self.running += 1
        try:
            await self._send_tokens(send, body, chat)
        finally:
            self.running -= 1
            if self._gate:
                self._gate.release()

    async def _send_tokens(self, send, body: dict, chat: bool) -> None:
        start = time.perf_counter()
        n = int(body.get("max_completion_tokens") or body["max_tokens"])
        prompt = body["prompt"] if not chat else " ".join(m["content"] for m in body["messages"])
        prompt_tokens = len(prompt.split()) if isinstance(prompt, str) else len(prompt)
        key = json.dumps(prompt)
        self.prefix_queries += prompt_tokens
        self.prefix_hits += prompt_tokens if key in self.cached else 0
        self.cached.add(key)
        continuous = bool((body.get("stream_options") or {}).get("continuous_usage_stats"))
        kind = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": "x", "object": kind, "created": 0, "model": body["model"]}

        def usage(done: int) -> dict:
            return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}

        def choice(text: str, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else {"content": text}
                return {"index": 0, "delta": delta, "finish_reason": None}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": None}

        def content(k: int) -> bytes | str:
            """The chunk's bytes, or with per-chunk usage a %-template for (done, prompt + done)."""
            if not continuous:
                return _event({**base, "choices": [choice(" t" * k)]})
            fixed = json.dumps({**base, "choices": [choice(" t" * k)], "usage": usage(987654321)}, separators=(",", ":"))
            return "data: " + fixed.replace("987654321", "%d").replace(str(prompt_tokens + 987654321), "%d") + "\n\n"

        # Bytes built once per chunk size, not per chunk: as fast as it can, the server must
        # outrun any client, or a client benchmark measures the server.
        templates = {k: content(k) for k in {self.tokens_per_chunk, n % self.tokens_per_chunk or self.tokens_per_chunk}}
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        pending = [_event({**base, "choices": [choice("", role=True)]})] if chat else []
        done = 0
        while done < n:
            k = min(self.tokens_per_chunk, n - done)
            done += k
            wait = start + self.ttft_s + (done - k) * self.itl_s - time.perf_counter() if self.itl_s or done == k else 0
            if wait > 0 or len(pending) >= self.events_per_write:
                if pending:
                    await send({"type": "http.response.body", "body": b"".join(pending), "more_body": True})
                    pending = []
                if wait > 0:
                    await asyncio.sleep(wait)
            chunk = templates[k]
            pending.append(chunk if not continuous else (chunk % (done, prompt_tokens + done)).encode())
            self.generated += k
        pending += [_event({**base, "choices": [], "usage": usage(n)}), b"data: [DONE]\n\n"]
        await send({"type": "http.response.body", "body": b"".join(pending), "more_body": False})

    def __enter__(self) -> "StreamingServer":
        """Serve from a child process: a server sharing the client's GIL would delay its timestamps."""
        args = [sys.executable, __file__, "--port", self.base_url.rsplit(":", 1)[1],
                "--ttft-s", str(self.ttft_s), "--itl-s", str(self.itl_s), "--tokens-per-chunk",
                str(self.tokens_per_chunk), "--events-per-write", str(self.events_per_write)]
        if self.slots:
            args += ["--slots", str(self.slots)]
        if self.rejects:
            args += ["--rejects", self.rejects]
        if not self.resets:
            args += ["--no-resets"]
        if self.counting:
            args += ["--counting"]
        if self.degenerate_above is not None:
            args += ["--degenerate-above", str(self.degenerate_above)]
        if self.parsers:
            args += ["--parsers", self.parsers]
        self._child = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        if self.cpus:
            os.sched_setaffinity(self._child.pid, parse_cpus(self.cpus))
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if self._child.poll() is not None or time.monotonic() > deadline:
                    self._child.kill()
                    raise RuntimeError(f"streaming server on port {self.port} did not start")
                time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        self._child.kill()  # uvicorn's graceful stop would wait for streams whose clients left
        self._child.wait(timeout=10)

    def serve(self) -> None:
        """In this process, on uvloop, until killed."""
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error", lifespan="off",
                                interface="asgi3", loop="uvloop", http="httptools")
        uvicorn.Server(config).run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ttft-s", type=float, default=0.0)
    parser.add_argument("--itl-s", type=float, default=0.0)
    parser.add_argument("--tokens-per-chunk", type=int, default=1)
    parser.add_argument("--slots", type=int)
    parser.add_argument("--events-per-write", type=int, default=1)
    parser.add_argument("--rejects", choices=["token-ids", "all"])
    parser.add_argument("--no-resets", dest="resets", action="store_false")
    parser.add_argument("--counting", action="store_true")
    parser.add_argument("--degenerate-above", type=float)
    parser.add_argument("--parsers", choices=["parsed", "raw"])
    args = parser.parse_args()
    StreamingServer(args.ttft_s, args.itl_s, args.tokens_per_chunk, args.slots, args.events_per_write,
                    args.port, args.rejects, args.resets, counting=args.counting,
                    degenerate_above=args.degenerate_above, parsers=args.parsers).serve()


if __name__ == "__main__":
    main()

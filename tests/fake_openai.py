"""An OpenAI-compatible streaming completions server whose timings are set by the test.

It waits ttft_s before the first chunk and itl_s between chunks (deadlines from the request's
start, so sleep jitter does not accumulate), one token per chunk and a final usage chunk. It runs
on asyncio (uvicorn, which Prefect ships) so 32 streams cost the server nothing measurable.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse


class DelayServer:
    def __init__(self, ttft_s: float, itl_s: float):
        self.ttft_s, self.itl_s = ttft_s, itl_s
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request) -> StreamingResponse:
            start = time.perf_counter()
            body = await request.json()
            return StreamingResponse(self._events(body, start), media_type="text/event-stream")

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                                                     lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    async def _events(self, body: dict, start: float):
        n, prompt = int(body["max_tokens"]), body["prompt"]
        for i in range(n):
            await asyncio.sleep(max(0.0, start + self.ttft_s + i * self.itl_s - time.perf_counter()))
            yield "data: " + json.dumps({"id": "x", "object": "text_completion", "model": body["model"],
                                         "choices": [{"index": 0, "text": "t", "finish_reason": None}]}) + "\n\n"
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
        yield "data: " + json.dumps({"id": "x", "object": "text_completion", "model": body["model"], "choices": [],
                                     "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"

    def __enter__(self) -> "DelayServer":
        self._thread.start()
        while not self._server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

"""An OpenAI-compatible streaming completions server whose timings are set by the test.

It waits ttft_s before the first chunk and itl_s between chunks, sends one token per chunk and a
final usage chunk, so a client's TTFT, ITL and TPOT can be checked against known values.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class DelayServer:
    def __init__(self, ttft_s: float, itl_s: float):
        self.ttft_s, self.itl_s = ttft_s, itl_s
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                n = int(body["max_tokens"])
                prompt = body["prompt"]
                start = time.perf_counter()
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for i in range(n):
                    # Deadlines from the request's start: sleep jitter does not accumulate.
                    _sleep_until(start + server.ttft_s + i * server.itl_s)
                    self._event({"id": "x", "object": "text_completion", "model": body["model"],
                                 "choices": [{"index": 0, "text": "t", "finish_reason": None}]})
                self._event({"id": "x", "object": "text_completion", "model": body["model"], "choices": [],
                             "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                                       "total_tokens": len(prompt) + n}})
                self._chunk(b"data: [DONE]\n\n")
                self._chunk(b"")

            def _event(self, payload: dict) -> None:
                self._chunk(b"data: " + json.dumps(payload).encode() + b"\n\n")

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

        class Server(ThreadingHTTPServer):
            request_queue_size = 512  # the stdlib's 5 resets connections beyond 5 simultaneous streams

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "DelayServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _sleep_until(deadline: float) -> None:
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(min(left, 0.005) if left > 0.001 else 0)

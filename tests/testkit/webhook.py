"""A webhook receiver on 127.0.0.1: what a Slack or alerting endpoint would get, kept for a test to read."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class WebhookReceiver:
    """Records every POSTed JSON body; `wait_for(n)` returns them once n have arrived."""

    def __init__(self):
        self.posts: list[dict] = []
        received = self.posts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                received.append(json.loads(body or b"{}"))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/hook"

    def __enter__(self) -> WebhookReceiver:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def wait_for(self, count: int, timeout_s: float = 60.0) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while len(self.posts) < count and time.monotonic() < deadline:
            time.sleep(0.2)
        return list(self.posts)

"""A Prefect API that stalls once, as the embedded SQLite server does under load: a proxy in front of
the real server that passes a request matching `path_part` through (the server does the work) but
answers the client 503 "try again", as a reply lost to a timeout would look. Prefect's client then
sends the same request again."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"}


class StallingApi:
    def __init__(self, upstream: str, *, path_part: str, method: str = "POST"):
        self.upstream = upstream.rstrip("/")  # http://127.0.0.1:PORT/api
        self.path_part, self.method = path_part, method
        self.stalled: list[str] = []  # the requests whose answer the client never got
        self.seen: list[str] = []  # "METHOD path" of every request the proxy passed on
        self._server: ThreadingHTTPServer | None = None
        self._http = httpx.Client(timeout=60)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/api"

    def __enter__(self) -> StallingApi:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path = self.path.removeprefix("/api")
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP | {"host"}}
                reply = proxy._http.request(self.command, proxy.upstream + path, content=body, headers=headers)
                proxy.seen.append(f"{self.command} {path}")
                if self.command == proxy.method and proxy.path_part in path and not proxy.stalled:
                    proxy.stalled.append(path)
                    self._send(503, b'{"detail": "stalled"}', {"Content-Type": "application/json",
                                                                "Retry-After": "0"})
                    return
                self._send(reply.status_code, reply.content,
                           {k: v for k, v in reply.headers.items() if k.lower() not in HOP_BY_HOP})

            def _send(self, status: int, content: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _forward

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._http.close()

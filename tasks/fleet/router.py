"""The router in front of the fleet: HAProxy, driven through its runtime API.

A host that swaps is first drained at the router (no new requests; those in flight finish), then
swapped and checked by its own deploy, then admitted again. HAProxy's health checks decide whether
an admitted host really receives traffic: a host that serves nothing after its deploy stays out of
rotation by the router's own judgement, and is then put in maintenance so that it stays out until a
person (or the next rollout) admits it.

HAProxy was chosen over nginx and LiteLLM's proxy by what a rollout needs (docs/router.md): a server
taken out and put back over a socket, at once and without a reload that restarts workers; per-server
health checks; and counters of requests, responses and cut streams per server, read back the same
way. HAProxy 2.6 is in Debian.

Plain Python: the fleet flow calls it; nothing here imports Prefect.
"""

from __future__ import annotations

import csv
import io
import os
import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field

from tasks.errors import UnusableInput


class RouterConfig(BaseModel):
    """deployments/hosts.yaml's `router:`: where the fleet's clients come in."""

    admin: str = Field(..., description="HAProxy's stats socket at level admin: a path (unix socket) or host:port")
    backend: str = Field(..., description="The HAProxy backend whose servers are the hosts, each named as its host")
    frontend: str | None = Field(None, description="The frontend the clients reach; its counters are the fleet's "
                                                   "traffic in the fleet artifact (empty: the backend's)")
    drain_timeout_s: float = Field(300, gt=0, description="How long a drained host's requests in flight may take "
                                                          "to finish before its swap begins anyway")
    admit_timeout_s: float = Field(60, gt=0, description="How long an admitted host may take to pass the router's "
                                                         "health check before it is kept out of rotation")
    canary_window_s: float = Field(300, ge=0, description="How long the canary serves its share of live traffic "
                                                          "before the waves go on; 0: no live comparison")
    canary_share_percent: int = Field(50, ge=1, le=100, description="The canary's router weight during its window, "
                                                                    "in percent of its usual weight")
    canary_max_slowdown: float = Field(0.2, gt=0, description="A canary slower than the rest by more than this, and "
                                                              "outside the noise, is rolled back")


@dataclass(frozen=True)
class ServerStats:
    """One row of `show stat`: a server, the backend or the frontend."""

    name: str
    status: str  # UP, DOWN, DRAIN, MAINT, "UP 1/3" while a check rises, "no check"
    current: int  # sessions in flight
    queued: int
    requests: int  # HTTP requests (sessions where HAProxy reports no request count)
    responses_5xx: int
    cut_by_server: int  # srv_abrt: a response the server broke off (a stream cut by its death)
    connect_errors: int
    response_errors: int
    weight: int
    mean_response_ms: int  # rtime: over the last 1,024 requests
    mean_total_ms: int  # ttime
    user_weight: int = 0  # uweight: the weight set (through the socket or the configuration), up or down

    @property
    def in_rotation(self) -> bool:
        return self.status.startswith("UP") and self.weight > 0

    @property
    def failed(self) -> int:
        """Requests the clients saw fail: a 5xx answered, or a response cut off mid-stream."""
        return self.responses_5xx + self.cut_by_server


def _int(row: dict, key: str) -> int:
    try:
        return int(row.get(key) or 0)
    except ValueError:
        return 0


SEVERITY = re.compile(r"^\[(\d)\]: (.*)$", re.M)


def _refusal(answer: str) -> str | None:
    """The message of a refused command: an error or a warning (syslog severity 4 or worse: HAProxy
    2.6 warns "Invalid addr" of a change it did not make), or an unknown command (which it answers at
    severity 6, with its list of commands)."""
    for level, message in SEVERITY.findall(answer):
        if int(level) <= 4 or message.startswith("Unknown command"):
            return message.strip()
    return None


def _connect_unix(conn: socket.socket, path: Path) -> None:
    """Connect to a unix socket whatever its path's length: one longer than a socket address holds
    (107 bytes) is reached through its directory's descriptor, /proc/self/fd/N/name."""
    if len(str(path).encode()) < 100:
        conn.connect(str(path))
        return
    directory = os.open(path.parent, os.O_PATH)
    try:
        conn.connect(f"/proc/self/fd/{directory}/{path.name}")
    finally:
        os.close(directory)


class HAProxy:
    """HAProxy's runtime API: one command a connection, answered in text."""

    def __init__(self, config: RouterConfig, timeout_s: float = 10.0) -> None:
        self.config = config
        self.timeout_s = timeout_s

    def ask(self, command: str) -> str:
        """Send one command and read the whole answer; a socket that does not answer is one clear line."""
        admin = self.config.admin
        try:
            if ":" in admin and not admin.startswith("/"):
                host, port = admin.rsplit(":", 1)
                conn = socket.create_connection((host, int(port)), timeout=self.timeout_s)
            else:
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.settimeout(self.timeout_s)
                _connect_unix(conn, Path(admin))
        except (OSError, ValueError) as exc:
            raise RouterUnreachable(f"router {admin}: cannot connect ({exc})") from exc
        with conn:
            # HAProxy's messages then carry their syslog severity ("[3]: No such server."), so a
            # refusal is known by its level, not by guessing at its wording.
            conn.sendall(b"set severity-output number; " + command.encode() + b"\n")
            chunks = []
            while chunk := conn.recv(65536):
                chunks.append(chunk)
        answer = b"".join(chunks).decode(errors="replace")
        if refusal := _refusal(answer):
            raise RouterRefused(f"router {admin} refused '{command}': {refusal}")
        return answer

    def stats(self) -> dict[str, ServerStats]:
        """The backend's servers by name, with "BACKEND" and "FRONTEND" rows for the totals."""
        text = self.ask("show stat").lstrip().lstrip("# ")
        rows = {}
        for row in csv.DictReader(io.StringIO(text)):
            proxy, name = row.get("pxname"), row.get("svname", "")
            if proxy == self.config.backend or (proxy == self.config.frontend and name == "FRONTEND"):
                requests = _int(row, "req_tot") or _int(row, "stot")
                rows[name] = ServerStats(
                    name=name, status=row.get("status", ""), current=_int(row, "scur"), queued=_int(row, "qcur"),
                    requests=requests, responses_5xx=_int(row, "hrsp_5xx"), cut_by_server=_int(row, "srv_abrt"),
                    connect_errors=_int(row, "econ"), response_errors=_int(row, "eresp"),
                    weight=_int(row, "weight"), mean_response_ms=_int(row, "rtime"), mean_total_ms=_int(row, "ttime"),
                    user_weight=_int(row, "uweight"))
        if not any(name not in ("BACKEND", "FRONTEND") for name in rows):
            raise UnusableInput(f"router {self.config.admin}: backend '{self.config.backend}' has no servers")
        return rows

    def read(self) -> RouterReading:
        return RouterReading(at=time.time(), servers=self.stats())

    def server(self, name: str) -> ServerStats:
        found = self.stats().get(name)
        if found is None:
            raise UnusableInput(f"router {self.config.admin}: backend '{self.config.backend}' has no server "
                                f"'{name}' (name each host's server as the host)")
        return found

    def set_weight(self, name: str, percent: int) -> None:
        """A share of the host's usual weight (its weight in the configuration is 100%). HAProxy rounds
        the share of a server's configured weight down: at its default weight of 1 any share below
        100% is 0, no traffic at all, which is refused here rather than judged as a quiet canary."""
        self.ask(f"set weight {self.config.backend}/{name} {percent}%")
        if percent > 0 and self.server(name).user_weight == 0:
            self.ask(f"set weight {self.config.backend}/{name} 100%")
            raise RouterRefused(f"router {self.config.admin}: {percent}% of server {self.config.backend}/{name}'s "
                                "configured weight is 0, no traffic; give each host's server `weight 100` in "
                                "haproxy.cfg (as tasks/fleet/router.py haproxy_config writes it)")

    def set_state(self, name: str, state: str) -> None:
        self.ask(f"set server {self.config.backend}/{name} state {state}")

    def set_address(self, name: str, address: str, port: int) -> None:
        """Point a server at another address (its health check follows): a host's front door sends
        its slot to the port the new vLLM listens on. HAProxy 2.6 reports a change it made at the
        same severity as a refusal ("... port changed from '1' to '8001' ..."): that one is success."""
        try:
            self.ask(f"set server {self.config.backend}/{name} addr {address} port {port}")
        except RouterRefused as answer:
            if f"to '{port}'" not in str(answer) and "no need to change" not in str(answer):
                raise

    def drain(self, name: str, *, timeout_s: float | None = None, poll_s: float = 0.2) -> float:
        """Take the host out of rotation and wait for its requests in flight to finish: the seconds
        that took. Past the deadline it returns anyway; the swap's own stop then cuts what is left."""
        self.set_state(name, "drain")
        started = time.monotonic()
        deadline = started + (timeout_s or self.config.drain_timeout_s)
        while time.monotonic() < deadline:
            now = self.server(name)
            if now.current == 0 and now.queued == 0:
                break
            time.sleep(poll_s)
        return time.monotonic() - started

    def admit(self, name: str, *, timeout_s: float | None = None, poll_s: float = 0.2) -> ServerStats:
        """Put the host back; it takes traffic once the router's health check finds it up. A host the
        check still finds down at the deadline is put in maintenance: it stays out, and says so."""
        self.set_state(name, "ready")
        deadline = time.monotonic() + (timeout_s or self.config.admit_timeout_s)
        while True:
            now = self.server(name)
            if now.status.startswith("UP") and not now.status.startswith("UP "):  # "UP 1/3": still rising
                return now
            if now.status == "no check" or time.monotonic() > deadline:
                break
            time.sleep(poll_s)
        if not now.status.startswith("UP"):
            self.set_state(name, "maint")
            return self.server(name)
        return now

    @contextmanager
    def out_of_rotation(self, name: str) -> Iterator[OutOfRotation]:
        """The host drained before the body (a deploy, a rollback) and admitted after it, whatever it
        ended with: the router's health check then keeps a host that serves nothing out."""
        spell = OutOfRotation(drained_s=self.drain(name))
        try:
            yield spell
        finally:
            spell.admitted = self.admit(name)


@dataclass
class OutOfRotation:
    """A host's time out of rotation: how long its drain took, and its state once admitted again."""

    drained_s: float
    admitted: ServerStats | None = None  # set when the body has ended


def rotation(server: ServerStats) -> str:
    """A host's place at the router, as the fleet artifact says it."""
    if server.in_rotation:
        return "in rotation"
    if server.status == "MAINT":
        return "out of rotation: it failed the router's health check, kept in maintenance"
    return f"out of rotation: {server.status}"


class RouterUnreachable(UnusableInput):
    pass


class RouterRefused(UnusableInput):
    pass


@dataclass(frozen=True)
class RouterReading:
    at: float  # time.time() when read
    servers: dict[str, ServerStats]  # by server name, with "BACKEND" and "FRONTEND"


@dataclass(frozen=True)
class Traffic:
    """What the fleet's clients went through, from the router's counters: during the rollout (the
    difference between two readings), and the router's own mean latency before and after."""

    since: float  # the readings' times (time.time()): the window the counts cover
    until: float
    requests: int
    failed: int
    mean_response_ms_before: int
    mean_response_ms_after: int
    out_of_rotation: tuple[str, ...]  # the hosts the router does not send to at the end

    @classmethod
    def between(cls, before: RouterReading, after: RouterReading, *, frontend: bool) -> Traffic:
        first, last = before.servers, after.servers
        total = "FRONTEND" if frontend and "FRONTEND" in first and "FRONTEND" in last else "BACKEND"
        cut = last["BACKEND"].cut_by_server - first["BACKEND"].cut_by_server
        failed = last[total].responses_5xx - first[total].responses_5xx + cut
        return cls(since=before.at, until=after.at, requests=last[total].requests - first[total].requests,
                   failed=failed, mean_response_ms_before=first["BACKEND"].mean_response_ms,
                   mean_response_ms_after=last["BACKEND"].mean_response_ms,
                   out_of_rotation=tuple(sorted(n for n, s in last.items()
                                                if n not in ("BACKEND", "FRONTEND") and not s.in_rotation)))

HOLD_LUA = """-- Hold a request while the backend has no usable server, at most max_ms (then the frontend's next
-- rule answers 503). core.msleep yields to HAProxy: the wait costs no Lua time (tune.lua.session-timeout).
core.register_action("hold_while_down", { "http-req" }, function(txn, backend, max_ms)
    local limit, step, waited = tonumber(max_ms) or 0, 100, 0
    while txn.f:nbsrv(backend) == 0 and waited < limit do
        core.msleep(step)
        waited = waited + step
    end
end, 2)
"""


def haproxy_config(servers: list[tuple[str, str, int]], *, router: RouterConfig, bind: str,
                   hold_s: float | None = None, hold_lua: Path | None = None, disabled: bool = False) -> str:
    """An haproxy.cfg for the fleet, to start from or to compare with the one the router runs: one
    server per host (name, address, port), each health-checked on vLLM's /health every 0.5 s (two
    misses take it out, two answers put it back); a request whose connection fails is sent to another
    host (retries, redispatch); least connections, as long generations make round robin uneven.

    With `hold_s` (and `hold_lua`, where HOLD_LUA is written), a request that arrives while no server is
    usable waits up to that long for one instead of HAProxy's immediate 503 (a swap is a pause), then
    gets a JSON 503 with Retry-After; each answer names the server that gave it and its port
    (x-rollout-server: "a 41234").
    `disabled`: the servers start in maintenance, out of rotation until admitted (a host's front door).
    """
    admin = router.admin
    socket_line = (f"stats socket ipv4@{admin} level admin" if ":" in admin and not admin.startswith("/")
                   else f"stats socket {admin} mode 600 level admin")
    state = " disabled" if disabled else ""
    hosts = "\n".join(f"    server {name} {address}:{port} check{state}" for name, address, port in servers)
    lua = f"\n    lua-load {hold_lua}" if hold_s is not None else ""
    hold = "" if hold_s is None else (
        f"    http-request lua.hold_while_down {router.backend} {int(hold_s * 1000)}\n"
        f"    http-request return status 503 content-type application/json hdr Retry-After {max(1, int(hold_s))} "
        "string '{\"error\":{\"message\":\"no model is being served yet (a swap), retry later\",\"type\":"
        f"\"server_unavailable\",\"code\":503}}}}' if {{ nbsrv({router.backend}) eq 0 }}\n"
        "    http-response set-header x-rollout-server \"%[srv_name] %[bc_dst_port]\"\n")
    return f"""global
    {socket_line}{lua}

defaults
    mode http
    timeout connect 2s
    timeout client 10m
    timeout server 10m
    retries 3
    option redispatch

frontend {router.frontend or "clients"}
    bind {bind}
{hold}    default_backend {router.backend}

backend {router.backend}
    balance leastconn
    option httpchk GET /health
    default-server inter 500ms fall 2 rise 2 weight 100
{hosts}
"""

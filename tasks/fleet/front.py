"""A host's front door: HAProxy on the production port, the served vLLM behind it on a private one.

Without it the new vLLM of a deploy binds the production port, so a client can be answered by a model
that is still being checked (and then rolled back), and every request during a swap is refused. With
it, a new server starts on a private loopback port, is checked and benchmarked there, and is admitted
at promotion: one runtime-API call, the old one drained. While no server is admitted the front holds
each request (up to `hold_s`) instead of refusing it: a swap is a pause, not an error.

The front is the fleet's router mechanism (tasks/fleet/router.py: the same config writer, the same
runtime API), with a backend of two slots, `a` and `b`: the one serving, and the one the next server is
admitted to. It runs as a daemon of its own, recorded in models_root/.rollout/front/front.json, so that
no deploy's death (kill -9, a power cut of its process) closes the production port.

Plain Python: the CLI and the flows call it; nothing here imports Prefect.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from tasks.errors import UnusableInput
from tasks.fleet.router import HOLD_LUA, HAProxy, RouterConfig, RouterUnreachable, ServerStats, haproxy_config
from tasks.history.swap import write_record
from tasks.trust import read_state_text
from tasks.vllm.settings import ServerConfig
from tasks.vllm.process import process_start_time

SLOTS = ("a", "b")
BACKEND = "served"
FRONTEND = "clients"
# 300 s: under the OpenAI SDK's default 600 s timeout, so a client is told (a 503 with Retry-After)
# before it gives up on its own; longer than a restore of the demo's model and a mid-size model's
# start. A swap that takes longer (a 600 GB model's load) keeps the old server where memory allows,
# and otherwise answers 503 after the bound: no client waits for ever (docs/front-door).
HOLD_S = 300.0
PLACEHOLDER_PORT = 1  # a slot's address before any server is admitted to it (in maintenance: never used)


class FrontRecord(BaseModel):
    """front.json: the front door's daemon and where it listens."""

    pid: int = Field(..., gt=0)
    pid_started: str | None = None  # the process's start time: a reused pid is not the front
    host: str
    port: int = Field(..., gt=0, le=65535)
    hold_s: float = Field(..., ge=0)
    admin: str  # the runtime API's unix socket

    @property
    def url(self) -> str:
        return f"http://{'127.0.0.1' if self.host in ('0.0.0.0', '::') else self.host}:{self.port}"


def front_dir(run_dir: Path) -> Path:
    return run_dir / "front"


def read_front(run_dir: Path) -> FrontRecord | None:
    """The host's front door where one runs; None where none was started or it has stopped. A
    damaged record is one line naming it."""
    record = _recorded_front(run_dir)
    return record if record is not None and process_start_time(record.pid) == record.pid_started else None


def _recorded_front(run_dir: Path) -> FrontRecord | None:
    path = front_dir(run_dir) / "front.json"
    try:
        record = FrontRecord.model_validate(json.loads(read_state_text(path)))
    except FileNotFoundError:
        return None
    except (ValueError, ValidationError) as exc:
        raise UnusableInput(f"{path} is damaged ({str(exc).splitlines()[0]}): stop the front door's HAProxy by hand "
                            "if one runs, delete the file, and start it again with `rollout front start`") from exc
    return record


def front_status(run_dir: Path) -> tuple[str | None, bool]:
    """`rollout status`'s line on the front door, and whether it is down (a front that was started
    and no longer runs: its clients are refused, the first thing an operator must hear). No line
    where this host has no front door."""
    recorded = _recorded_front(run_dir)
    if recorded is None:
        return None, False
    down = (f"FRONT DOOR DOWN: its HAProxy (pid {recorded.pid}) on port {recorded.port} does not run, so clients "
            f"are refused; `rollout front start --models-root {run_dir.parent} --port {recorded.port}`")
    if read_front(run_dir) is None:
        return down, True
    try:
        serving = FrontDoor(recorded).serving()
    except UnusableInput:  # its runtime API does not answer
        return down, True
    if serving is None:
        return (f"  front:    {recorded.url} holds each request up to {recorded.hold_s:.0f} s: no server admitted",
                False)
    return f"  front:    {recorded.url} sends clients to 127.0.0.1:{serving.port} (slot {serving.name})", False


def _port_taken(host: str, port: int) -> str | None:
    """Why the front cannot listen on host:port, or None where it can."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def start_front(run_dir: Path, *, port: int, host: str = "127.0.0.1", hold_s: float = HOLD_S) -> FrontRecord:
    """Write the front's HAProxy config and start it as a daemon on host:port, both slots empty (a
    request is held until a server is admitted). One already running is returned as it is."""
    if (running := read_front(run_dir)) is not None:
        if running.port != port:
            raise UnusableInput(f"--port {port}: this host's front door already runs on port {running.port} "
                                f"(pid {running.pid}); `rollout front stop` first")
        return running
    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
    if not os.access(haproxy, os.X_OK):
        raise UnusableInput("the front door needs HAProxy: apt-get install haproxy (Debian's 2.6 or later)")
    if why := _port_taken(host, port):
        raise UnusableInput(f"--port {port}: cannot listen on {host}:{port} ({why}); a vLLM serving there directly "
                            "must stop first: `rollout stop`, then `rollout front start`, then `rollout rollback`")
    where = front_dir(run_dir)
    where.mkdir(parents=True, exist_ok=True)
    admin, pid_file = where / "haproxy.sock", where / "haproxy.pid"
    (where / "hold.lua").write_text(HOLD_LUA)
    # The socket named relative to the front's directory, HAProxy started there: a unix socket's path
    # is at most 107 bytes, and a models root can be deeper than that leaves (CI's pytest paths were).
    config = haproxy_config([(slot, "127.0.0.1", PLACEHOLDER_PORT) for slot in SLOTS],
                            router=_router(f"unix@{admin.name}"),
                            bind=f"{host}:{port}", hold_s=hold_s, hold_lua=where / "hold.lua", disabled=True)
    (where / "haproxy.cfg").write_text(config)
    started = subprocess.run([haproxy, "-D", "-f", str(where / "haproxy.cfg"), "-p", str(pid_file)],
                             capture_output=True, text=True, timeout=30, cwd=where)
    if started.returncode != 0:
        said = [line for line in started.stderr.splitlines() if "ALERT" in line] or started.stderr.splitlines()
        raise UnusableInput(f"the front door's HAProxy did not start: {(said or ['no message'])[0].strip()} "
                            f"(config: {where / 'haproxy.cfg'})")
    pid = int(pid_file.read_text().split()[0])
    record = FrontRecord(pid=pid, pid_started=process_start_time(pid), host=host, port=port, hold_s=hold_s,
                         admin=str(admin))
    write_record(where / "front.json", record.model_dump(mode="json"))
    FrontDoor(record).slots()  # its runtime API answers
    return record


def stop_front(run_dir: Path, *, timeout_s: float = 10.0) -> FrontRecord | None:
    """Stop the front door (requests in flight are cut; the production port closes). Returns what
    was stopped, or None where none ran."""
    record = read_front(run_dir)
    if record is not None:
        os.kill(record.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while process_start_time(record.pid) == record.pid_started and time.monotonic() < deadline:
            time.sleep(0.05)
        if process_start_time(record.pid) == record.pid_started:
            os.kill(record.pid, signal.SIGKILL)
    (front_dir(run_dir) / "front.json").unlink(missing_ok=True)
    return record


def _router(admin: Path | str) -> RouterConfig:
    return RouterConfig(admin=str(admin), backend=BACKEND, frontend=FRONTEND, admit_timeout_s=30)


@dataclass(frozen=True)
class Slot:
    """One of the front's two backend slots, as HAProxy has it now."""

    name: str
    port: int | None  # None: never admitted
    stats: ServerStats

    @property
    def serving(self) -> bool:
        return self.stats.in_rotation


class FrontDoor:
    """The running front's two slots, driven through HAProxy's runtime API."""

    def __init__(self, record: FrontRecord) -> None:
        self.record = record
        self.haproxy = HAProxy(_router(record.admin))

    def slots(self) -> list[Slot]:
        stats = self.haproxy.stats()
        ports = self._ports()
        return [Slot(name=name, port=ports.get(name), stats=stats[name]) for name in SLOTS if name in stats]

    def _ports(self) -> dict[str, int | None]:
        """Each slot's port, from `show servers state` (its columns: be_id be_name srv_id srv_name
        srv_addr ... srv_port at 18)."""
        ports: dict[str, int | None] = {}
        for line in self.haproxy.ask(f"show servers state {BACKEND}").splitlines():
            fields = line.split()
            if len(fields) > 18 and fields[1] == BACKEND and fields[3] in SLOTS:
                port = int(fields[18]) if fields[18].isdigit() else None
                ports[fields[3]] = None if port == PLACEHOLDER_PORT else port
        return ports

    def serving(self) -> Slot | None:
        """The slot that clients reach now, if any."""
        return next((slot for slot in self.slots() if slot.serving), None)

    def admit(self, port: int, *, address: str = "127.0.0.1", timeout_s: float = 30.0) -> Slot:
        """Send clients to the server on `port`, then drain the slot that served before and put it in
        maintenance. The new server is admitted to the other slot; it takes traffic once HAProxy's
        health check finds it up, and until then the old one serves on. Raises where the new one is
        not up by the deadline (the old one is left serving)."""
        slots = self.slots()
        current = next((slot for slot in slots if slot.port == port and slot.serving), None)
        if current is not None:
            return current
        spare = next(slot for slot in sorted(slots, key=lambda s: s.serving) if not slot.serving)
        self.haproxy.set_state(spare.name, "maint")
        self.haproxy.set_address(spare.name, address, port)
        admitted = self.haproxy.admit(spare.name, timeout_s=timeout_s)
        if not admitted.in_rotation:
            raise RouterUnreachable(f"front door on port {self.record.port}: the server on {address}:{port} did not "
                                    f"pass its health check within {timeout_s:.0f} s ({admitted.status})")
        for slot in slots:
            if slot.name != spare.name:
                self.retire(slot.name)
        return Slot(name=spare.name, port=port, stats=admitted)

    def retire(self, slot: str, *, timeout_s: float = 300.0) -> float:
        """Take a slot out: no new request goes there, those in flight finish (up to `timeout_s`),
        then it is put in maintenance. The seconds the drain took (none for a slot in maintenance
        already: drained, it would leave maintenance and be health-checked at its old port)."""
        if self.haproxy.server(slot).status == "MAINT":
            return 0.0
        drained = self.haproxy.drain(slot, timeout_s=timeout_s)
        self.haproxy.set_state(slot, "maint")
        return drained

    def close(self, *, timeout_s: float = 300.0) -> float:
        """Take every slot out: from here each request is held until a server is admitted (the gap of
        a swap where the host cannot hold two servers). The seconds the drain took."""
        return max([self.retire(slot.name, timeout_s=timeout_s) for slot in self.slots()], default=0.0)


def behind_front(server: ServerConfig, run_dir: Path, *, restore: bool = False) -> ServerConfig:
    """Where this host's front door listens on the server's port, the server goes behind it: on a
    free loopback port, where no client reaches it until it is admitted. A restore always takes a
    free port (the one it had may have been taken since). Elsewhere the server is left as it is."""
    front = read_front(run_dir)
    if front is None or not (restore or server.port == front.port):
        return server
    return server.model_copy(update={"host": "127.0.0.1", "port": 0})


def admit_behind_front(run_dir: Path, base_url: str) -> str | None:
    """Send the front's clients to the server at `base_url` (the old one drained, then out): the
    promotion of a checked server, or a restored one. Returns the front's URL, or None where no front
    door runs."""
    front = read_front(run_dir)
    if front is None:
        return None
    FrontDoor(front).admit(int(base_url.rsplit(":", 1)[1].split("/")[0]))
    return front.url


def hold_at_front(run_dir: Path) -> float | None:
    """Before the serving server stops: clients are held at the front from here (their requests in
    flight finish first) until the next server is admitted. The seconds the drain took, or None
    where no front door runs."""
    front = read_front(run_dir)
    return FrontDoor(front).close() if front is not None else None

"""How long a swap leaves the host answering nothing, measured as a client would see it.

From the last completion the old server answered to the first completion the server that ends up
serving answered (the new one, or the last good one restored): a probe thread sends a one-token
completion every `interval_s` to whatever server the host's state file names at that moment, and
notes which process group answered. Its answers are the measurement, not the timestamps of the
flow's own steps: a server that is "ready" by our readiness check but does not answer a client
yet still counts as down, and a restart of the old one counts from its first real answer.
Answers from a server that does not end up serving (a new one whose check failed) do not end the
gap: a client that reached it was answered by a model that was then rolled back.

An answer counts as a client would count it: a generated token (a 200 whose choice ended by
length or stop with a completion token, not an error or an aborted request), on a connection of
its own (a client of a swap connects afresh; a kept-alive one can outlive the server's listening
socket), from the server the state file named both when the probe was sent and when its answer
came back (a swap that changed the record in between leaves the answer unattributed, never given
to the wrong server). The last swap's probes are kept in `<run_dir>/gap-probe.jsonl`, so a gap in the summary
can be read against what a client saw.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx
from pydantic import BaseModel

from tasks.trust import read_state_text


@dataclass(frozen=True)
class ProbeAnswer:
    at: float  # epoch seconds when the answer (or the failure) came back
    pgid: int | None  # the process group the state file named when the probe was sent and answered
    ok: bool  # a generated token came back
    sent: float = 0.0  # epoch seconds when the probe was sent
    outcome: str = ""  # what came back: "token", an HTTP status, an error's name, "no server", "moved"


class Unavailability(BaseModel):
    """One swap's gap as the probe saw it."""

    seconds: float | None  # None: nothing answered before, or nothing answers after
    last_old_answer: datetime | None
    first_new_answer: datetime | None
    probes: int
    failed: int
    interval_s: float
    held: bool = False  # behind a front door: the clients waited there (held), none was refused

    def text(self) -> str:
        if self.seconds is not None and self.held:
            return f"{self.seconds:.1f} s held at the front door (requests waited; none was refused)"
        if self.seconds is not None:
            return (f"{self.seconds:.1f} s without an answer ({self.failed} of {self.probes} probes every "
                    f"{self.interval_s:g} s failed)")
        if self.last_old_answer is None:
            return "nothing answered before the swap"
        return f"nothing has answered since {self.last_old_answer:%H:%M:%S} UTC"


def _target(state_file: Path) -> tuple[str, str, int] | None:
    """(base URL, served model name, process group) of the server the host records now."""
    try:
        state = json.loads(read_state_text(state_file))
        command = state.get("command", [])
        name = command[command.index("--served-model-name") + 1] if "--served-model-name" in command else ""
        return (state["base_url"], name, int(state["pgid"])) if state.get("base_url") else None
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


@dataclass
class GapProbe:
    """A one-token completion every `interval_s` through a swap; a context manager around it. A
    quarter of a second: the gap it reports is within that of a client asking more often, and four
    one-token requests a second are no load on a server (it pauses for the check and the sweep)."""

    state_file: Path
    interval_s: float = 0.25
    api_key: str | None = None
    answers: list[ProbeAnswer] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _paused: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> GapProbe:
        self._thread = threading.Thread(target=self._run, name="gap-probe", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.answers:
            self.save(self.state_file.with_name("gap-probe.jsonl"))

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        # No pooled connection (max_keepalive_connections=0): every probe connects as a new client does.
        limits = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(timeout=max(1.0, 2 * self.interval_s), headers=headers, limits=limits) as http:
            while not self._stop.is_set():
                if self._paused.is_set():
                    self._stop.wait(self.interval_s)
                    continue
                began, sent = time.monotonic(), time.time()
                target = _target(self.state_file)
                outcome = _ask(http, target) if target is not None else "no server"
                at = time.time()
                if target is not None and _target(self.state_file) != target:
                    outcome = "moved"  # the record changed while it was asked: which server answered is unknown
                self.answers.append(ProbeAnswer(at=at, pgid=target[2] if target else None, ok=outcome == "token",
                                                sent=sent, outcome=outcome))
                self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - began)))

    def pause(self) -> None:
        """No probes while the new server is checked and benchmarked: four requests a second would
        be load the benchmark did not ask for. A failure resumes them before the restore."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    def wait_for_answer(self, pgid: int, timeout_s: float = 5.0) -> None:
        """Until the probe has an answer from `pgid` (the server now serving), at most timeout_s."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not any(a.ok and a.pgid == pgid for a in list(self.answers)):
            time.sleep(0.05)

    def save(self, path: Path) -> None:
        """Every probe of this swap, a JSON line each (sent, answered, group, outcome)."""
        path.write_text("".join(json.dumps({"sent": round(a.sent, 3), "at": round(a.at, 3), "pgid": a.pgid,
                                            "outcome": a.outcome}) + "\n" for a in list(self.answers)))

    def held(self, *, old_pgid: int) -> Unavailability:
        """Behind a front door, at the new server's admission: from the old group's last answer to
        now, the time the front held its clients (the new server's own first answer, on its private
        port, came before its checks; no client saw it)."""
        last = self.gap(old_pgid=old_pgid, new_pgid=None).last_old_answer
        now = datetime.now(timezone.utc)
        return Unavailability(seconds=(now - last).total_seconds() if last else None, last_old_answer=last,
                              first_new_answer=now, probes=0, failed=0, interval_s=self.interval_s, held=True)

    def gap(self, *, old_pgid: int | None, new_pgid: int | None) -> Unavailability:
        """From the old group's last answer to the first answer after it by the group now serving."""
        answers = list(self.answers)
        old = [a.at for a in answers if a.ok and a.pgid == old_pgid]
        last_old = max(old) if old else None
        new = [a.at for a in answers if a.ok and a.pgid == new_pgid and (last_old is None or a.at > last_old)]
        first_new = min(new) if new else None
        between = [a for a in answers
                   if (last_old is None or a.at > last_old) and (first_new is None or a.at < first_new)]

        def stamp(t: float | None) -> datetime | None:
            return datetime.fromtimestamp(t, timezone.utc) if t is not None else None

        return Unavailability(seconds=first_new - last_old if last_old is not None and first_new is not None else None,
                              last_old_answer=stamp(last_old), first_new_answer=stamp(first_new),
                              probes=len(between), failed=sum(not a.ok or a.pgid != new_pgid for a in between),
                              interval_s=self.interval_s)


def _ask(http: httpx.Client, target: tuple[str, str, int]) -> str:
    """One one-token completion: "token" where one was generated, else what came back instead."""
    url, name, _ = target
    try:
        reply = http.post(f"{url}/v1/completions",
                          json={"model": name, "prompt": "1", "max_tokens": 1, "temperature": 0})
    except httpx.HTTPError as err:
        return type(err).__name__
    if reply.status_code != 200:
        return f"HTTP {reply.status_code}"
    try:
        body = reply.json()
        choice = body["choices"][0]
        generated = int((body.get("usage") or {}).get("completion_tokens") or 0)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return "malformed answer"
    if choice.get("finish_reason") not in ("length", "stop") or generated < 1:
        return f"no token ({choice.get('finish_reason')})"
    return "token"

"""What this host serves now, as its operator asks at 2 AM (`rollout status`): read from the host's
own records and its process table, and asked of the server itself, with no Prefect in between."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import httpx

from tasks.errors import UnusableInput, first_line
from tasks.history.last_good import LastGood, read_last_good, read_previous_good
from tasks.history.swap import abandoned_swap
from tasks.history.tuned import TunedSettings, read_tuned
from tasks.trust import read_state_text
from tasks.vllm.process import serving_group, stop_group, vllm_groups

# `rollout status` exit codes, for scripts: 0 serving, 3 nothing serves, 1 the recorded server is dead
# (or alive and not answering).
SERVING, DEAD, NOTHING = 0, 1, 3


@dataclass(frozen=True)
class HostStatus:
    """The recorded server (server.json), whether its process group lives and answers, and the
    deployment records beside it."""

    run_dir: Path
    state: dict | None  # server.json as written at launch; None when nothing was recorded
    alive_pgid: int | None  # its process group, while it still runs vLLM
    answers: list[str] | None  # the models its /v1/models lists; None when it does not answer
    last_good: LastGood | None
    previous_good: LastGood | None
    tuned: TunedSettings | None
    unfinished_swap: dict | None = None  # swap.json of a deploy that died mid-swap
    front: str | None = None  # the front door's line (tasks/fleet/front.py front_status, added by the CLI)
    front_down: bool = False

    @property
    def exit_code(self) -> int:
        if self.unfinished_swap is not None or self.front_down:
            return DEAD
        if self.state is None:
            return NOTHING
        return SERVING if self.alive_pgid is not None and self.answers else DEAD

    @property
    def is_last_good(self) -> bool:
        """Whether the recorded server is the last good deployment's: alive or dead, it is the one
        last-good.json names (its process group), or was launched from the same command."""
        if self.state is None or self.last_good is None:
            return False
        if self.last_good.serving_pgid is not None:
            return self.last_good.serving_pgid == self.state.get("pgid")
        return self.alive_pgid is None and _flag(self.state.get("command", []), "--model") == str(
            self.last_good.model_dir)

    def rollback_target(self) -> LastGood | None:
        """What `rollout rollback` would start: the last good deployment where it does not serve,
        the good one before it where it does (flows/operate.py, rollback_model)."""
        if self.last_good is None:
            return None
        serving_last_good = self.alive_pgid is not None and self.last_good.serving_pgid == self.alive_pgid
        return self.previous_good if serving_last_good else self.last_good

    def lines(self) -> list[str]:
        """The status in words, verdict first."""
        state, good = self.state, self.last_good
        swap = self.unfinished_swap
        first = [f"UNFINISHED SWAP: the deploy of {swap.get('what')} (pid {swap.get('deploy_pid')}) died mid-swap; "
                 f"its guard brings the last good deployment back, or run `rollout recover --models-root "
                 f"{swap.get('models_root') or self.run_dir.parent}`"] if swap else []
        if self.front_down:
            first.insert(0, self.front)
        if state is None:
            head = [f"nothing serves: no server recorded in {self.run_dir / 'server.json'}"]
        else:
            since = datetime.fromtimestamp((self.run_dir / "server.json").stat().st_mtime, timezone.utc)
            model = _flag(state.get("command", []), "--served-model-name") or _flag(state.get("command", []),
                                                                                      "--model")
            if self.alive_pgid is None:
                verdict = f"DEAD: the recorded vLLM (process group {state.get('pgid')}) is not running"
            elif not self.answers:
                verdict = f"NOT ANSWERING: vLLM process group {self.alive_pgid} runs, {state.get('base_url')} " \
                          "does not list a model"
            else:
                verdict = f"serving {', '.join(self.answers)} at {state.get('base_url')}/v1"
            what = (f"{good.what} (the last good deployment)" if self.is_last_good
                    else f"{model} (not the last good deployment: a deploy in progress or one that did not finish)")
            head = [verdict, f"  model:    {what}", f"  since:    {since:%Y-%m-%d %H:%M:%S} UTC",
                    f"  process:  group {state.get('pgid')}, " + ("alive" if self.alive_pgid else "dead"),
                    f"  log:      {state.get('log_path')}"]
        if good is not None:
            head.append(f"  last good: {good.what} at port {good.server.port if good.server else '-'}")
            if (record := good.record) is not None:
                single = f"{record.single_stream_tok_s:,.1f}" if record.single_stream_tok_s else "-"
                peak = f"{record.peak_tok_s:,.1f}" if record.peak_tok_s else "-"
                head.append(f"  benchmark: single stream {single} tok/s, peak {peak} tok/s at c="
                            f"{record.knee_concurrency or '-'} ({record.time:%Y-%m-%d %H:%M} UTC, {record.status})")
                if record.answers is not None:
                    head.append(f"  answers:  {record.answers.accuracy:.0%} of {len(record.answers.outputs)} probes "
                                "right")
        if self.front is not None and not self.front_down:
            head.insert(1, self.front)
        if (back := self.rollback_target()) is not None:
            head.append(f"  rollback to: {back.what} (`rollout rollback`)")
        if self.tuned is not None:
            head.append(f"  tuned:    {self.tuned.candidate} (promoted {self.tuned.time:%Y-%m-%d %H:%M} UTC)")
        return first + head


STATE_FILES = ("server.json", "last-good.json")


def _damage(path: Path) -> str | None:
    """Why the record at `path` cannot be read; None when it reads, or is absent."""
    try:
        text = read_state_text(path)
        if path.name != "server.json":
            LastGood.model_validate_json(text)
        elif not isinstance(state := json.loads(text), dict) or type(state.get("pgid")) is not int or not isinstance(
                state.get("command", []), list) or not isinstance(state.get("base_url", ""), str):
            return "not the object a launch writes (an integer pgid, a command list, a base_url string)"
    except FileNotFoundError:
        return None
    except ValueError as exc:
        return first_line(exc)
    return None


def check_state_files(run_dir: Path) -> None:
    """Refuse to act on a host whose records cannot be read: a damaged server.json or last-good.json
    read as "nothing here" once left a healthy server untracked beside a new one, or reaped as stale.
    The message names the file and the vLLM process groups found on the host."""
    for path in (run_dir / name for name in STATE_FILES):
        if (why := _damage(path)) is not None:
            seen = ", ".join(f"process group {g}" + (f" on port {p}" if p else "")
                             for g, p in sorted(vllm_groups().items()))
            raise UnusableInput(f"{path} is damaged ({why}); vLLM on this host: {seen or 'none'}. Repair or remove "
                                "the file, or pass --take-over to stop those servers and start afresh")


def take_over(run_dir: Path) -> list[int]:
    """The operator's choice on a host whose records are damaged: set the damaged files aside (never
    deleted: they are the evidence) and stop every vLLM process group on the host. Nothing is done
    where the records read."""
    damaged = [run_dir / name for name in STATE_FILES if _damage(run_dir / name) is not None]
    if not damaged:
        return []
    stamp = f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}"
    for path in damaged:
        path.replace(path.with_name(f"{path.name}.damaged-{stamp}"))
    stopped = sorted(vllm_groups())
    for pgid in stopped:
        stop_group(pgid)
    return stopped


def _flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command[:-1] else None


def _listed(base_url: str, timeout_s: float) -> list[str] | None:
    try:
        reply = httpx.get(f"{base_url}/v1/models", timeout=timeout_s)
        reply.raise_for_status()
        return [m["id"] for m in reply.json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def host_status(run_dir: Path, timeout_s: float = 5.0) -> HostStatus:
    """The host's serving state; asks the server's /v1/models only while its process group runs."""
    check_state_files(run_dir)  # never read a damaged record as "nothing here": it may hide a live server
    path = run_dir / "server.json"
    state = json.loads(read_state_text(path)) if path.exists() else None
    alive = serving_group(run_dir / "server.json") if state else None
    answers = _listed(state["base_url"], timeout_s) if alive and state.get("base_url") else None
    last = read_last_good(run_dir)
    return HostStatus(run_dir=run_dir, state=state, alive_pgid=alive, answers=answers, last_good=last,
                      previous_good=read_previous_good(run_dir),
                      tuned=read_tuned(run_dir, last.repo_id) if last else None, unfinished_swap=abandoned_swap(run_dir))

"""What every `rollout` command shares: the app, the option groups generated from the models, and
the one-line failures (a bad input names its flag and exits 2; never a traceback for a user's mistake)."""

from __future__ import annotations

import os

# Prefect reads these when it starts its embedded server; analytics also races SQLite at start-up.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# The embedded server's concurrency leases on disk, not in memory: a restart in memory lost the lease a
# dead deploy held, and the host's lock stayed taken until someone reset it (field-facts, turn 3).
os.environ.setdefault("PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE", "prefect.server.concurrency.lease_storage.filesystem")

import logging  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Annotated  # noqa: E402

import typer  # noqa: E402
import typer.rich_utils  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from flows.cli.options import BadOption, Group, flag  # noqa: E402
from tasks.answers.spec import AnswerSpec  # noqa: E402
from tasks.bench.spec import BenchSpec  # noqa: E402
from tasks.deployment.config import DeployConfig  # noqa: E402
from tasks.errors import RolloutError, UnusableInput, first_line  # noqa: E402 
from tasks.vllm.settings import VllmSettings  # noqa: E402

if TYPE_CHECKING:  # the commands import their stages when they run: `rollout --help` stays instant
    from tasks.bench.results import LevelResult

# `--help` lays its tables out at no less than this width: narrower, rich cuts the flag names
# (two options both showed as `--data-parallel-si…`); a narrow terminal wraps lines instead.
typer.rich_utils.MAX_WIDTH = max(shutil.get_terminal_size((120, 24)).columns, 150)

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="The `rollout` command: demo, validate and deploy from a shell.")

RepoId = Annotated[str, typer.Argument(help="Hub repo, e.g. moonshotai/Kimi-K2.5")]

# The run form, the engine and the load, each field an option (flows/options.py); the engine's
# defaults are the form's (expert parallelism on), not VllmSettings' own.
STAGE = Group(DeployConfig, "Staging", only=("revision", "models_root", "hub_endpoint", "mirror_endpoint",
                                             "hf_token_secret", "disk_margin_gb", "evict", "pinned_models",
                                             "max_parallel_downloads"))
FORM = Group(DeployConfig, "Deployment", skip=("repo_id", "vllm", "bench", "answers"))
ENGINE = Group(VllmSettings, "vLLM engine",
               defaults=DeployConfig.model_fields["vllm"].get_default(call_default_factory=True))
LOAD = Group(BenchSpec, "Benchmark")
ANSWERS = Group(AnswerSpec, "Answer check", prefix="answers_")


def from_options(group: Group, options: dict, **fields):
    """The group's model from the command's options; a bad value is one line naming it, exit 2."""
    try:
        return group.model(**group.values(options), **fields)
    except BadOption as exc:
        typer.echo(f"error: {exc}", err=True)
    except ValidationError as exc:  # nothing has started
        err = exc.errors()[0]
        if err["loc"]:  # the field's flag, as the user typed it
            typer.echo(f"error: bad option {flag(group.prefix + str(err['loc'][0]), sys.argv[1:])}: "
                       f"{err['msg'].removeprefix('Value error, ')}", err=True)
        else:  # a rule over several fields: their flags, as the user typed them
            typer.echo(f"error: {as_flags(err['msg'].removeprefix('Value error, '))}", err=True)
    raise typer.Exit(2)


def as_flags(message: str) -> str:
    """A form's field paths (`bench.input_len`) in a message, as the command's flags (`--input-len`)."""
    prefixes = {"answers": ANSWERS.prefix}
    return re.sub(r"\b(?:(vllm|bench|answers)\.)?([a-z_]+[a-z])\b",
                  lambda m: flag(prefixes.get(m[1], "") + m[2], sys.argv[1:]) if m[1] else m[0], message)


def deploy_config(repo_id: str, options: dict) -> DeployConfig:
    """The run form from a command's options: the form's own, the engine's, the load's and the answer check's."""
    return from_options(FORM, options, repo_id=repo_id, vllm=from_options(ENGINE, options),
                         bench=from_options(LOAD, options), answers=from_options(ANSWERS, options))


def check_prefect() -> None:
    """A Prefect API that does not answer is one line naming it, in seconds: not five minutes of
    retries and event-worker dumps that name neither Prefect nor the URL. Without PREFECT_API_URL
    the embedded server starts with the command, its own logs to a file (embedded_server.py)."""
    import httpx
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        from flows.cli.embedded_server import route_server_logs

        route_server_logs()
        return
    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=10).raise_for_status()
    except httpx.HTTPError as exc:
        typer.echo(f"error: the Prefect API at {url} (PREFECT_API_URL) does not answer ({first_line(exc)}): start "
                   "it, or unset PREFECT_API_URL to run on the embedded server", err=True)
        raise typer.Exit(2)


def exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so the flow's finally stops vLLM instead of orphaning it."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    _one_line_failures()


class _NoRolloutTraceback(logging.Formatter):
    """The console's formatter, less the traceback of a RolloutError: Prefect logs a failed flow's
    exception with its traceback, and a failed check (a canary that failed validation) is no crash.
    Only the console's: the run's logs in the UI keep it, and any other exception keeps it too."""

    def __init__(self, inner: logging.Formatter):
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        if not (record.exc_info and (isinstance(record.exc_info[1], RolloutError)
                                     or prefect_api_lost(record.exc_info[1]))):
            return self.inner.format(record)
        saved = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text = saved


# Prefect's client services that retry in the background and dump their tracebacks to the terminal
# when the API goes away ("Service 'EventsWorker' failed", "EventsWorker - Still processing items"):
# to a file instead. The services log under their class names.
CLIENT_SERVICE_LOGGERS = ("prefect.events.clients", "prefect._internal.concurrency", "EventsWorker", "APILogWorker")
CLIENT_LOG = Path(os.environ.get("TMPDIR", "/tmp")) / "rollout-prefect-client.log"


def _one_line_failures() -> None:
    from prefect.logging.handlers import PrefectConsoleHandler

    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and not isinstance(handler.formatter, _NoRolloutTraceback):
            handler.setFormatter(_NoRolloutTraceback(handler.formatter or logging.Formatter()))
    # Prefect's log shipper writes "--- Error logging to API ---" straight to stderr while logging's
    # raiseExceptions is on (the library's debugging default); a command's user gets the one line.
    logging.raiseExceptions = False
    for name in CLIENT_SERVICE_LOGGERS:
        service = logging.getLogger(name)
        if not any(isinstance(h, logging.FileHandler) for h in service.handlers):
            service.addHandler(logging.FileHandler(CLIENT_LOG, delay=True))
        service.propagate = False


def prefect_api_lost(exc: BaseException) -> str | None:
    """The Prefect API's URL where `exc`, or an error it came from, is a connection to it that failed
    mid-run; None for anything else."""
    import httpx
    from prefect.settings import PREFECT_API_URL

    url = (PREFECT_API_URL.value() or "").rstrip("/")
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None:
            return None
        if isinstance(seen, httpx.TransportError) and url:
            try:
                if str(seen.request.url).startswith(url):
                    return url
            except RuntimeError:  # an error raised with no request attached
                pass
        seen = seen.__cause__ or seen.__context__
    return None


def fail(exc: BaseException, *, run_dir: Path | None = None) -> None:
    """One line and the error's exit code (2: unusable input such as an unreachable hub; else 1). A
    Prefect API that went away mid-run is named with what the host (`run_dir`) serves now."""
    if (url := prefect_api_lost(exc)) is not None:
        now = ""
        if run_dir is not None:
            from tasks.history.serving import host_status

            try:
                now = f"; this host: {host_status(run_dir).lines()[0]}"
            except Exception as unread:  # the one line still names the API; the records' trouble after it
                now = f"; this host's records: {first_line(unread)}"
        typer.echo(f"error: the Prefect API at {url} went away mid-run ({first_line(exc)}){now}", err=True)
        raise typer.Exit(2)
    if isinstance(exc, RolloutError):
        typer.echo(f"error: {str(exc).splitlines()[0]}", err=True)
        raise typer.Exit(exc.exit_code)
    if "ephemeral Prefect API server" in str(exc):  # another command holds the embedded server's database
        typer.echo("error: Prefect's embedded server did not start: another rollout command is probably using it. "
                   "Wait for it, or run `prefect server start` and set PREFECT_API_URL=http://127.0.0.1:4200/api "
                   "so that commands share one server", err=True)
        raise typer.Exit(2)
    typer.echo(f"error: {first_line(exc)}", err=True)
    raise typer.Exit(1)


def check_models_root(models_root: Path) -> None:
    """A typo in --models-root must not put 595 GB on the wrong filesystem: its parent must exist."""
    from tasks.disk import check_models_root

    try:
        check_models_root(models_root)
    except UnusableInput as exc:
        typer.echo(f"error: {str(exc).replace('models_root', '--models-root', 1)}", err=True)
        raise typer.Exit(2)


def check_hub(repo_id: str, revision: str, endpoint: str | None):
    """One hub call before Prefect starts: a typo in the repo or the endpoint fails in a second."""
    from tasks.hub import resolve_snapshot

    try:
        return resolve_snapshot(repo_id, revision, endpoint)
    except UnusableInput as exc:
        fail(exc)


def check_before_the_flow(config: DeployConfig, *, will_serve: bool = True) -> None:
    """What a command checks in seconds before its flow starts Prefect: the models root's parent,
    then the hub and the repo (a typo fails in a second, not after the embedded server starts), and
    for a command that serves the model, code the repo would have vLLM run without consent."""
    from tasks.profiles.remote_code import code_in_snapshot, refusal

    check_models_root(config.models_root)
    snapshot = check_hub(config.repo_id, config.revision, config.hub_endpoint)
    if will_serve:
        try:
            refused = refusal(code_in_snapshot(snapshot, config.hub_endpoint), repo_id=config.repo_id,
                              commit=snapshot.commit, run_dir=config.run_dir, given=config.vllm.trust_remote_code)
        except UnusableInput as exc:
            fail(exc)
        if refused is not None:
            fail(refused)


def print_table(results: list[LevelResult], stop: str | None) -> None:
    """The headline figures (95% intervals as ±), then what they mean in words."""
    from tasks.bench.report import headline_table, verdict_lines

    typer.echo(headline_table(results).to_string(index=False) + "\n")
    typer.echo("\n".join(line.replace("**", "") for line in verdict_lines(results, stop)))



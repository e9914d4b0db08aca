"""The `rollout` command: demo, validate and deploy from a shell."""

from __future__ import annotations

import os

# Prefect reads these when it starts its embedded server; analytics also races SQLite at start-up.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# The embedded server's concurrency leases on disk, not in memory: a restart in memory lost the lease a
# dead deploy held, and the host's lock stayed taken until someone reset it (field-facts, turn 3).
os.environ.setdefault("PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE", "prefect.server.concurrency.lease_storage.filesystem")

import json  # noqa: E402
import logging  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Annotated, Optional  # noqa: E402

import typer  # noqa: E402
import typer.rich_utils  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from flows.options import BadOption, Group, flag, with_options  # noqa: E402
from tasks.answers.spec import AnswerSpec  # noqa: E402
from tasks.bench.spec import BenchSpec  # noqa: E402
from tasks.deployment.config import DeployConfig  # noqa: E402
from tasks.errors import BenchConfigError, RolloutError, UnusableInput, first_line  # noqa: E402 
from tasks.vllm.settings import VllmSettings  # noqa: E402

if TYPE_CHECKING:  # the commands import their stages when they run: `rollout --help` stays instant
    from tasks.bench.results import LevelResult

# `--help` lays its tables out at no less than this width: narrower, rich cuts the flag names
# (two options both showed as `--data-parallel-si…`); a narrow terminal wraps lines instead.
typer.rich_utils.MAX_WIDTH = max(shutil.get_terminal_size((120, 24)).columns, 150)

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)

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


def _from_options(group: Group, options: dict, **fields):
    """The group's model from the command's options; a bad value is one line naming it, exit 2."""
    try:
        return group.model(**group.values(options), **fields)
    except BadOption as exc:
        typer.echo(f"error: {exc}", err=True)
    except ValidationError as exc:  # nothing has started
        err = exc.errors()[0]
        if err["loc"]:
            typer.echo(f"error: bad option {'.'.join(str(p) for p in err['loc'])}: {err['msg']}", err=True)
        else:  # a rule over several fields: their flags, as the user typed them
            typer.echo(f"error: {_as_flags(err['msg'].removeprefix('Value error, '))}", err=True)
    raise typer.Exit(2)


def _as_flags(message: str) -> str:
    """A form's field paths (`bench.input_len`) in a message, as the command's flags (`--input-len`)."""
    prefixes = {"answers": ANSWERS.prefix}
    return re.sub(r"\b(?:(vllm|bench|answers)\.)?([a-z_]+[a-z])\b",
                  lambda m: flag(prefixes.get(m[1], "") + m[2]) if m[1] else m[0], message)


def _deploy_config(repo_id: str, options: dict) -> DeployConfig:
    """The run form from a command's options: the form's own, the engine's, the load's and the answer check's."""
    return _from_options(FORM, options, repo_id=repo_id, vllm=_from_options(ENGINE, options),
                         bench=_from_options(LOAD, options), answers=_from_options(ANSWERS, options))


def _check_prefect() -> None:
    """A Prefect API that does not answer is one line naming it, in seconds: not five minutes of
    retries and event-worker dumps that name neither Prefect nor the URL. Without PREFECT_API_URL
    the embedded server starts with the command."""
    import httpx
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        return
    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=10).raise_for_status()
    except httpx.HTTPError as exc:
        typer.echo(f"error: the Prefect API at {url} (PREFECT_API_URL) does not answer ({first_line(exc)}): start "
                   "it, or unset PREFECT_API_URL to run on the embedded server", err=True)
        raise typer.Exit(2)


def _exit_on_sigterm() -> None:
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
        if not (record.exc_info and isinstance(record.exc_info[1], RolloutError)):
            return self.inner.format(record)
        saved = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text = saved


def _one_line_failures() -> None:
    from prefect.logging.handlers import PrefectConsoleHandler

    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and not isinstance(handler.formatter, _NoRolloutTraceback):
            handler.setFormatter(_NoRolloutTraceback(handler.formatter or logging.Formatter()))


def _fail(exc: BaseException) -> None:
    """One line and the error's exit code (2: unusable input such as an unreachable hub; else 1)."""
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


def _check_models_root(models_root: Path) -> None:
    """A typo in --models-root must not put 595 GB on the wrong filesystem: its parent must exist."""
    from tasks.disk import check_models_root

    try:
        check_models_root(models_root)
    except UnusableInput as exc:
        typer.echo(f"error: {str(exc).replace('models_root', '--models-root', 1)}", err=True)
        raise typer.Exit(2)


def _check_hub(repo_id: str, revision: str, endpoint: str | None) -> None:
    """One hub call before Prefect starts: a typo in the repo or the endpoint fails in a second."""
    from tasks.hub import resolve_snapshot

    try:
        resolve_snapshot(repo_id, revision, endpoint)
    except UnusableInput as exc:
        _fail(exc)


def _print_table(results: list[LevelResult], stop: str | None) -> None:
    """The headline figures (95% intervals as ±), then what they mean in words."""
    from tasks.bench.report import headline_table, verdict_lines

    typer.echo(headline_table(results).to_string(index=False) + "\n")
    typer.echo("\n".join(line.replace("**", "") for line in verdict_lines(results, stop)))


@app.command()
def demo(
    work_dir: Annotated[Path, typer.Option(help="Where the demo keeps its hub, models and logs")] = Path("demo-work"),
) -> None:
    """Build a tiny MoE, serve it from a local hub, deploy and benchmark it on vLLM (CPU)."""
    from flows.demo import run_demo

    _exit_on_sigterm()
    _check_prefect()
    try:
        int4, result = run_demo(work_dir.absolute(), say=lambda line: typer.echo(line, err=True))
    except Exception as exc:
        _fail(exc)
    typer.echo(f"\nINT4 variant {int4.repo_id}: validation {int4.validation.verdict} "
               f"({int4.validation.modules_packed} packed modules; validated, not served on CPU)")
    typer.echo(f"Deployed {result.prepared.repo_id}@{result.prepared.commit[:12]} on {result.platform}")
    if (answers := result.record.answers) is not None:
        typer.echo(f"Answer check passed: {answers.accuracy:.0%} of {len(answers.outputs)} probes answered right"
                   + (f", perplexity of the reference text {answers.perplexity:.3g}" if answers.perplexity else ""))
    typer.echo("")
    _print_table(result.results, result.sweep_end)
    if result.record.compared:
        typer.echo(f"\nCompared with the previous demo run, {result.record.compared}.\nNot gated: the demo "
                   "compares; `rollout deploy` and the nightly gate at 10%, outside the noise.")
    else:
        typer.echo(f"\nFirst demo run in {work_dir}: the next one will compare itself with this one.")
    typer.echo(
        "\nThe runs, their artifacts (deploy-demo-tiny-moe: the run's summary) and logs are in Prefect's database."
        "\nOpen them in the UI:  prefect server start   then browse http://127.0.0.1:4200/runs"
    )


@app.command()
def validate(
    target: Annotated[str,
                      typer.Argument(help="Local checkpoint directory, or a Hub repo id (read by range requests)")],
    revision: Annotated[str, typer.Option(help="Revision, for a repo id")] = "main",
    endpoint: Annotated[Optional[str], typer.Option(help="Hub URL, for a repo id; default HF_ENDPOINT")] = None,
    *, as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON")] = False,
) -> None:
    """Check a checkpoint's quantization config against its safetensors headers.

    Exit 0 on pass, 1 on violations, 2 on unusable input.
    """
    from tasks.checkpoint.rules import validate_checkpoint, validate_remote

    local = Path(target)
    try:
        if local.exists() or not REPO_ID.match(target):
            report = validate_checkpoint(local)
        else:
            report = validate_remote(target, revision, endpoint)
    except UnusableInput as exc:  # an unreadable checkpoint, an unknown repo, a hub that does not answer
        if as_json:
            typer.echo(json.dumps({"verdict": "error", "error": str(exc), "violations": []}))
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    if as_json:
        typer.echo(report.model_dump_json(indent=2))
    else:
        typer.echo(f"{report.verdict}: {report.source} (read {report.bytes_read:,} of {report.total_bytes:,} bytes)")
        for v in report.violations + report.warnings:
            typer.echo(f"  {v.rule}: {v.module}: {v.message}")
        for note in report.notes:
            typer.echo(f"  note: {note}")
    raise typer.Exit(0 if report.verdict == "pass" else 1)


@app.command()
@with_options(STAGE)
def prepare(
    repo_id: RepoId,
    as_json: Annotated[bool, typer.Option("--json", help="Print the prepared model as JSON")] = False,
    **options,
) -> None:
    """Stage a model without touching the GPUs: resolve, disk plan, fetch, validate (prepare-model).

    Tonight's model, downloaded and checked in the afternoon, so the nightly only swaps servers.
    """
    from flows.prepare import prepare_model

    _exit_on_sigterm()
    _check_prefect()
    config = _from_options(STAGE, options, repo_id=repo_id)
    _check_models_root(config.models_root)
    _check_hub(config.repo_id, config.revision, config.hub_endpoint)
    try:
        prepared = prepare_model(config)
    except Exception as exc:
        _fail(exc)
    if as_json:
        typer.echo(prepared.model_dump_json(indent=2))
        return
    report = prepared.validation
    typer.echo(f"prepared {prepared.repo_id}@{prepared.commit[:12]}: {prepared.total_bytes / 1e9:.2f} GB in "
               f"{prepared.model_dir}\nvalidation {report.verdict}: {report.modules_packed} packed modules, "
               f"{len(report.warnings)} warning(s)")


@app.command()
@with_options(FORM, ENGINE, LOAD, ANSWERS)
def deploy(repo_id: RepoId, **options) -> None:
    """Fetch, validate, serve and benchmark a model (the deploy-model flow, run here).

    A server that serves the host's last good deployment keeps serving while the new model downloads;
    a failure after it was stopped restarts it. Every field of the run form, the vLLM settings and the
    benchmark is an option.
    """
    from flows.deploy import deploy_model

    _exit_on_sigterm()
    _check_prefect()
    config = _deploy_config(repo_id, options)
    _check_models_root(config.models_root)
    _check_hub(config.repo_id, config.revision, config.hub_endpoint)
    try:
        result = deploy_model(config)
    except Exception as exc:
        _fail(exc)
    if (answers := result.record.answers) is not None:
        typer.echo(f"answer check passed: {answers.accuracy:.0%} of {len(answers.outputs)} probes right")
    _print_table(result.results, result.sweep_end)
    if result.record.compared:
        typer.echo(f"\nregression gate: {result.record.compared}")
    if result.base_url:
        typer.echo(f"\nserving {config.served_model_name or config.repo_id}@{result.prepared.commit[:12]} at "
                   f"{result.base_url}/v1")


@app.command()
@with_options(LOAD)
def bench(
    base_url: Annotated[str, typer.Option(help="OpenAI-compatible server, e.g. http://gpu-host:8000")],
    model: Annotated[str, typer.Option(help="Model name as the server lists it in /v1/models")],
    max_concurrency: Annotated[Optional[int], typer.Option(help="Sweep 1, 2, 4, ... up to this instead")] = None,
    *, tokenizer: Annotated[Optional[Path], typer.Option(help="Tokenizer folder, for chat prompts")] = None,
    vocab_size: Annotated[Optional[int], typer.Option(help="Vocab size, for token-id prompts")] = None,
    results_dir: Annotated[Optional[Path], typer.Option(help="Default: bench-results/<model>-<time>")] = None,
    api_key: Annotated[Optional[str], typer.Option(envvar="OPENAI_API_KEY", help="Server API key")] = None,
    **options,
) -> None:
    """Sweep concurrency against any OpenAI-compatible server: no Prefect, no deploy."""
    from datetime import datetime, timezone

    import httpx

    from tasks.bench.load import probe_prompts, run_level
    from tasks.bench.prompts import level_prompts
    from tasks.bench.report import save_results
    from tasks.bench.spec import geometric_levels
    from tasks.bench.sweep import sweep
    from tasks.orchestration.artifacts import model_slug

    if max_concurrency:
        options["concurrency_levels"] = ",".join(map(str, geometric_levels(max_concurrency)))
    spec = _from_options(LOAD, options)
    if vocab_size is None and tokenizer is None and spec.dataset is None and spec.token_id_prompts:
        # No vocabulary at hand: text, whose lengths the server's own usage counts then give.
        spec = spec.model_copy(update={"token_id_prompts": False})
        typer.echo("no --vocab-size or --tokenizer: sending text prompts, input lengths from the server's usage counts")
    try:
        level_prompts(spec, 1, vocab_size, tokenizer=tokenizer)
    except BenchConfigError as exc:
        typer.echo(f"error: {exc} (--tokenizer, --vocab-size or --dataset)", err=True)
        raise typer.Exit(2)
    base_url = base_url.rstrip("/").removesuffix("/v1")
    try:
        listed = httpx.get(f"{base_url}/v1/models", timeout=10,
                           headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        listed.raise_for_status()
        served = [m["id"] for m in listed.json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        typer.echo(f"error: --base-url {base_url}: no OpenAI model list at /v1/models ({reason})", err=True)
        raise typer.Exit(2)
    if model not in served:
        typer.echo(f"error: --model {model!r} is not served at {base_url}; it serves {', '.join(served)}", err=True)
        raise typer.Exit(1)
    try:
        probed = probe_prompts(base_url, model, spec, vocab_size=vocab_size, tokenizer=tokenizer, api_key=api_key)
    except BenchConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    if probed.token_id_prompts != spec.token_id_prompts:
        typer.echo(f"{base_url} refuses token-id prompts: sending text, input lengths from its usage counts")
    spec = probed
    out = results_dir or Path("bench-results") / f"{model_slug(model)}-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}"

    def level(c: int) -> LevelResult:
        row = run_level(base_url, model, spec, concurrency=c, vocab_size=vocab_size, tokenizer=tokenizer,
                        api_key=api_key, results_dir=out)
        typer.echo(f"c={c}: {row.output_throughput:.1f} output tok/s, median TTFT {row.ttft.median or 0:.1f} ms"
                   + (f"  [{row.flags}]" if row.flags else ""))
        return row

    stops: list[str] = []
    rows = sweep(spec, level, stops.append)
    facts = {"Server": base_url, "Load": spec.load}
    save_results(rows, out, f"Benchmark of {model}", facts=facts, stop=stops[0] if stops else None)
    typer.echo("")
    _print_table(rows, stops[0] if stops else None)
    typer.echo(f"\nresults: {out}")



@app.command()
def history(
    model: Annotated[Optional[str], typer.Argument(help="Repo id; default: every model")] = None,
    threshold: Annotated[float, typer.Option(help="Fraction worse than the previous good run that is a regression")
                         ] = 0.1,
    wide: Annotated[bool, typer.Option(help="Also print vLLM version, GPUs, host and load")] = False,
    *, host: Annotated[Optional[str], typer.Option(help="Only this host's runs (its ROLLOUT_HOST name)")] = None,
) -> None:
    """Benchmarked deployments read back from Prefect's artifacts, oldest first; each compared with
    the previous good run of the same model on the same GPUs under the same load.

    Exit 1 when the newest run of a model regressed beyond the threshold.
    """
    import pandas as pd

    from tasks.history.runs import comparison, readable
    from tasks.orchestration.artifacts import read_history

    if not 0 <= threshold < 1:
        typer.echo(f"error: bad option --threshold {threshold}: a fraction in [0, 1)", err=True)
        raise typer.Exit(2)
    if model is not None and not REPO_ID.match(model):
        typer.echo(f"error: bad argument MODEL {model!r}: expected a repo id like org/name", err=True)
        raise typer.Exit(2)
    table = comparison([r for r in read_history(model) if host is None or r.host == host], threshold)
    if table.empty:
        typer.echo(f"no benchmarked deployments{f' of {model}' if model else ''}{f' on {host}' if host else ''} in "
                   "Prefect's history")
        raise typer.Exit(0)
    with pd.option_context("display.width", 250, "display.max_columns", None):
        typer.echo(readable(table, wide).to_string(index=False, na_rep="-"))
    newest = table.groupby("model").tail(1)
    for row in newest[newest["regression"] != ""].itertuples():
        typer.echo(f"regression: {row.model} at {row.revision}: {row.regression}")
    raise typer.Exit(1 if (newest["regression"] != "").any() else 0)


@app.command()
@with_options(FORM, ENGINE, LOAD, ANSWERS)
def tune(
    repo_id: RepoId,
    space: Annotated[Optional[Path], typer.Option(help="The candidate space, YAML or JSON (TuneSpace's fields); "
                                                       "default: the 8-GPU Kimi-K2.5 space")] = None,
    winner_rule: Annotated[str, typer.Option(help="peak or single-stream")] = "peak",
    *, max_hours: Annotated[Optional[float], typer.Option(help="Stop measuring after this long")] = None,
    promote: Annotated[bool, typer.Option(help="The winner's settings become this host's deployment settings")
                       ] = False,
    **options,
) -> None:
    """Find the best serving configuration by measurement (the tune-model flow, run here): each
    candidate checked in milliseconds, the survivors started, checked and swept one after another."""
    import yaml

    from flows.tune import TuneConfig, tune_model
    from tasks.tuning.space import TuneSpace

    _exit_on_sigterm()
    _check_prefect()
    deploy = _deploy_config(repo_id, options)
    _check_models_root(deploy.models_root)
    try:
        candidates = TuneSpace.model_validate(yaml.safe_load(space.read_text()) or {}) if space else TuneSpace()
    except (OSError, yaml.YAMLError) as exc:
        typer.echo(f"error: --space {space}: {first_line(exc)}", err=True)
        raise typer.Exit(2)
    except ValidationError as exc:
        err = exc.errors()[0]
        typer.echo(f"error: --space {space}: {'.'.join(str(p) for p in err['loc'])}: {err['msg']}", err=True)
        raise typer.Exit(2)
    try:
        config = TuneConfig(deploy=deploy, space=candidates, winner_rule=winner_rule, max_hours=max_hours,
                            promote=promote)
    except ValidationError as exc:
        err = exc.errors()[0]
        typer.echo(f"error: bad option --{str(err['loc'][0]).replace('_', '-')}: {err['msg']}", err=True)
        raise typer.Exit(2)
    _check_hub(deploy.repo_id, deploy.revision, deploy.hub_endpoint)
    try:
        results = tune_model(config)
    except Exception as exc:
        _fail(exc)
    import pandas as pd

    from tasks.orchestration.artifacts import tuning_rows
    from tasks.tuning.measure import winner

    with pd.option_context("display.width", 250, "display.max_columns", None, "display.max_colwidth", 60):
        rows = [{k: "-" if v is None else v for k, v in row.items()} for row in tuning_rows(results)]
        typer.echo(pd.DataFrame(rows).to_string(index=False))
    best = winner(results, config.winner_rule)
    if best is None:
        typer.echo("\nerror: no winner: no candidate was measured (each one's cause is in the table)", err=True)
        raise typer.Exit(1)
    typer.echo(f"\nwinner: {best.name}" + (" (promoted: the next deploy of this model here uses it)" if promote
                                           else ""))


@app.command()
def notify(
    block: Annotated[str, typer.Option(help="The Prefect notification block to send through, as "
                                            "<block-type>/<block-name>, e.g. slack-webhook/ops")],
) -> None:
    """Install the automations of deployments/automations.yaml on the Prefect server: a message
    when a deploy rolls back or the nightly fails."""
    from tasks.orchestration.notify import install_automations

    if block.count("/") != 1 or not all(block.split("/")):
        typer.echo(f"error: --block {block!r}: expected <block-type>/<block-name>, e.g. slack-webhook/ops", err=True)
        raise typer.Exit(2)
    try:
        names = install_automations(block)
    except UnusableInput as exc:
        _fail(exc)
    for name in names:
        typer.echo(f"automation {name!r}: notifies through {block}")


ModelsRoot = Annotated[Path, typer.Option(help="The host's models root (its state is in models_root/.rollout)")]


@app.command()
def status(models_root: ModelsRoot = Path("/models"),
           as_json: Annotated[bool, typer.Option("--json", help="Print the records as JSON")] = False) -> None:
    """What this host serves: model, commit, since when, URL, whether its process group lives and
    answers, the last benchmark and answer check, the tuned settings in use.

    Exit 0 serving, 3 nothing serves, 1 the recorded server is dead or does not answer.
    """
    from tasks.history.serving import host_status

    try:
        found = host_status(models_root / ".rollout")
    except UnusableInput as exc:
        _fail(exc)
    if as_json:
        typer.echo(json.dumps({"exit_code": found.exit_code, "server": found.state, "alive_pgid": found.alive_pgid,
                               "models": found.answers,
                               "last_good": found.last_good.model_dump(mode="json") if found.last_good else None},
                              indent=2))
    else:
        typer.echo("\n".join(found.lines()))
    raise typer.Exit(found.exit_code)


@app.command()
def stop(models_root: ModelsRoot = Path("/models")) -> None:
    """Stop the host's vLLM server (the stop-model flow, in the run history); `rollout rollback`
    starts the last good deployment again."""
    from flows.operate import HostTarget, stop_model

    _exit_on_sigterm()
    _check_prefect()
    try:
        pgid = stop_model(HostTarget(models_root=models_root))
    except Exception as exc:
        _fail(exc)
    typer.echo(f"stopped vLLM process group {pgid}; nothing serves on this host" if pgid
               else "nothing was running on this host")


@app.command()
def rollback(models_root: ModelsRoot = Path("/models"),
             startup_timeout_s: Annotated[float, typer.Option(help="Load deadline, seconds")] = 1800) -> None:
    """Bring a good deployment back at its own address (the rollback-model flow): the last good one
    where it does not serve; where it does, the good one before it."""
    from flows.operate import HostTarget, rollback_model

    _exit_on_sigterm()
    _check_prefect()
    try:
        now = rollback_model(HostTarget(models_root=models_root, startup_timeout_s=startup_timeout_s))
    except Exception as exc:
        _fail(exc)
    typer.echo(f"serving {now}")


@app.command()
def recover(models_root: ModelsRoot = Path("/models"),
            startup_timeout_s: Annotated[float, typer.Option(help="Load deadline, seconds")] = 1800) -> None:
    """Finish a swap whose deploy died: the last good deployment serving again, or nothing done
    where it serves. A swap's guard runs it by itself; exit 0 when the last good one serves."""
    from flows.operate import HostTarget, rollback_model

    _exit_on_sigterm()
    _check_prefect()
    try:
        now = rollback_model(HostTarget(models_root=models_root, startup_timeout_s=startup_timeout_s), recover=True)
    except Exception as exc:
        _fail(exc)
    typer.echo(f"serving {now}")


@app.command()
def logs(models_root: ModelsRoot = Path("/models"),
         lines: Annotated[int, typer.Option("--lines", "-n", help="How many of the last lines")] = 60) -> None:
    """The tail of the host's vLLM log (the server serving now, or the last one started)."""
    from tasks.vllm.log import log_tail

    run_dir = models_root / ".rollout"
    try:
        recorded = Path(json.loads((run_dir / "server.json").read_text())["log_path"])
    except (OSError, ValueError, KeyError, TypeError):
        recorded = run_dir / "vllm.log"
    if not recorded.is_file():
        typer.echo(f"error: --models-root {models_root}: no vLLM log at {recorded}", err=True)
        raise typer.Exit(2)
    typer.echo(log_tail(recorded, lines))


HostsPath = Annotated[Path, typer.Option("--hosts", help="The fleet's hosts file")]
HOSTS_FILE = Path("deployments/hosts.yaml")


def _hosts(path: Path):
    from tasks.fleet.hosts import HostsFile

    try:
        return HostsFile.read(path)
    except UnusableInput as exc:
        _fail(exc)


@app.command()
def deployments(
    hosts: HostsPath = HOSTS_FILE,
    out: Annotated[Path, typer.Option(help="The prefect.yaml to write")] = Path("deployments/prefect.yaml"),
    check: Annotated[bool, typer.Option(help="Write nothing; exit 1 when OUT is not what HOSTS renders to")] = False,
) -> None:
    """Render the hosts file into the Prefect deployments of every host and of the fleet."""
    from tasks.fleet.hosts import render

    text = render(_hosts(hosts))
    if check:
        same = out.exists() and out.read_text() == text
        typer.echo(f"{out} {'matches' if same else 'is out of date with'} {hosts}")
        raise typer.Exit(0 if same else 1)
    out.write_text(text)
    typer.echo(f"wrote {out}: the deployments of {len(_hosts(hosts).hosts)} host(s) and the fleet")


@app.command()
def fleet(
    hosts: HostsPath = HOSTS_FILE,
    revision: Annotated[Optional[str], typer.Option(help="Branch, tag or commit; default: the hosts file's")] = None,
    wave_size: Annotated[Optional[int], typer.Option(help="Hosts deployed at once after the canary")] = None,
) -> None:
    """Roll the hosts file's model out over its hosts (the fleet-rollout flow, run here): the canary
    first, then waves, each host deployed by its own worker; the first host that fails stops it."""
    from prefect.settings import PREFECT_API_URL

    from flows.fleet import fleet_rollout
    from tasks.fleet.rollout import fleet_rows

    if not PREFECT_API_URL.value():
        typer.echo("error: rollout fleet runs each host's deploy through its worker: set PREFECT_API_URL to the "
                   "Prefect server the workers poll", err=True)
        raise typer.Exit(2)
    spec = _hosts(hosts)
    changes = {"revision": revision} if revision else {}
    try:
        config = spec.fleet(**({"wave_size": wave_size} if wave_size else {}))
        config = config.model_copy(update={"deploy": config.deploy.model_copy(update=changes)})
    except ValidationError as exc:
        err = exc.errors()[0]
        typer.echo(f"error: bad option --{str(err['loc'][0]).replace('_', '-')}: {err['msg']}", err=True)
        raise typer.Exit(2)
    _check_hub(config.deploy.repo_id, config.deploy.revision, config.deploy.hub_endpoint)
    _exit_on_sigterm()
    _check_prefect()
    try:
        outcomes = fleet_rollout(config)
    except Exception as exc:
        _fail(exc)
    import pandas as pd

    rows = [{k: v for k, v in row.items() if k not in ("flow_run_id", "failures", "verdict")}
            for row in fleet_rows(outcomes, config.hosts, config.outlier_slowdown)]
    with pd.option_context("display.width", 250, "display.max_columns", None):
        typer.echo(pd.DataFrame(rows).to_string(index=False, na_rep="-"))


@app.command()
def mirror(
    models_root: Annotated[Path, typer.Option(help="The host's models root; its HF cache is models_root/hub")
                           ] = Path("/models"),
    host: Annotated[str, typer.Option(help="Address to listen on; 0.0.0.0 serves the other hosts")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on")] = 8090,
) -> None:
    """Serve this host's verified HF cache read-only over the Hub's file route, for the hosts after it
    in a fleet rollout (their `mirror_endpoint`). Runs until stopped."""
    from tasks.mirror import CacheMirror

    cache = models_root / "hub"
    if not models_root.is_dir():
        typer.echo(f"error: --models-root {models_root}: no such folder", err=True)
        raise typer.Exit(2)
    cache.mkdir(exist_ok=True)  # a fresh host's cache: it serves what its deploys fetch from now on
    _exit_on_sigterm()
    try:
        served = CacheMirror(cache, host, port, log=lambda line: typer.echo(line))
    except OSError as exc:
        typer.echo(f"error: --port {port}: cannot listen on {host}:{port} ({exc.strerror})", err=True)
        raise typer.Exit(2)
    typer.echo(f"mirror of {cache} at {served.endpoint}", err=True)
    try:
        served.server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        served.server.server_close()


if __name__ == "__main__":
    app()

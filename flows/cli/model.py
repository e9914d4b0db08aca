"""`rollout demo`, `validate`, `prepare`, `deploy` and `tune`: a model from the Hub to a checked, measured
server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from pydantic import ValidationError

from flows.cli.common import (
    ANSWERS,
    ENGINE,
    FORM,
    LOAD,
    REPO_ID,
    STAGE,
    RepoId,
    app,
    check_before_the_flow,
    check_hub,
    check_models_root,
    check_prefect,
    deploy_config,
    exit_on_sigterm,
    fail,
    from_options,
    print_table,
)
from flows.cli.options import with_options
from tasks.errors import UnusableInput, first_line

if TYPE_CHECKING:
    pass


@app.command()
def demo(
    work_dir: Annotated[Path, typer.Option(help="Where the demo keeps its hub, models and logs")] = Path("demo-work"),
) -> None:
    """Build a tiny MoE, serve it from a local hub, deploy and benchmark it on vLLM (CPU)."""
    from flows.demo import run_demo

    exit_on_sigterm()
    check_prefect()
    try:
        int4, result, kimi_int4, kimi = run_demo(work_dir.absolute(), say=lambda line: typer.echo(line, err=True))
    except Exception as exc:
        fail(exc)
    typer.echo(f"\nINT4 variant {int4.repo_id}: validation {int4.validation.verdict} "
               f"({int4.validation.modules_packed} packed modules; validated, not served on CPU)")
    typer.echo(f"Deployed {result.prepared.repo_id}@{result.prepared.commit[:12]} on {result.platform}")
    if (answers := result.record.answers) is not None:
        typer.echo(f"Answer check passed: {answers.accuracy:.0%} of {len(answers.outputs)} probes answered right"
                   + (f", perplexity of the reference text {answers.perplexity:.3g}" if answers.perplexity else ""))
    typer.echo("")
    print_table(result.results, result.sweep_end)
    if result.record.compared:
        typer.echo(f"\nCompared with the previous demo run, {result.record.compared}.\nNot gated: the demo "
                   "compares; `rollout deploy` and the nightly gate at 10%, outside the noise.")
    else:
        typer.echo(f"\nFirst demo run in {work_dir}: the next one will compare itself with this one.")
    for prepared, deployed in ((kimi_int4, kimi),) if kimi is not None else ():
        typer.echo(f"\nINT4 variant {prepared.repo_id}: validation {prepared.validation.verdict} "
                   f"({prepared.validation.modules_packed} packed modules, in text_config as Kimi-K2.5 has them)")
        typer.echo(f"Deployed {deployed.prepared.repo_id}@{deployed.prepared.commit[:12]}: Kimi-K2.5's tiktoken tokenizer "
                   "(remote code, consented), its thinking template, the kimi_k2 parsers, a vision tower")
        if (answers := deployed.record.answers) is not None:
            typer.echo(f"Answer check passed: {answers.accuracy:.0%} of {len(answers.outputs)} probes answered right "
                       "(completion, chat in instant mode, the reasoning probe thinking, a tool call parsed back)")
        peak = max(deployed.results, key=lambda r: r.output_throughput, default=None)
        if peak is not None:
            typer.echo(f"Peak {peak.output_throughput:.0f} output tok/s at concurrency {peak.concurrency}")
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
    from tasks.trust import printable  # names from the checkpoint cannot forge a line of the report

    local = Path(target)
    try:
        if local.exists() or not REPO_ID.match(target):
            report = validate_checkpoint(local)
        else:
            report = validate_remote(target, revision, endpoint)
    except UnusableInput as exc:  # an unreadable checkpoint, an unknown repo, a hub that does not answer
        line = printable(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        if as_json:
            typer.echo(json.dumps({"verdict": "error", "error": line, "violations": []}))
        typer.echo(f"error: {line}", err=True)
        raise typer.Exit(2)
    if as_json:
        typer.echo(report.model_dump_json(indent=2))
    else:
        typer.echo(f"{report.verdict}: {report.source} (read {report.bytes_read:,} of {report.total_bytes:,} bytes)")
        for v in report.violations + report.warnings:
            typer.echo(printable(f"  {v.rule}: {v.module}: {v.message}"))
        for note in report.notes:
            typer.echo(printable(f"  note: {note}"))
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

    exit_on_sigterm()
    check_prefect()
    config = from_options(STAGE, options, repo_id=repo_id)
    check_before_the_flow(config, will_serve=False)
    try:
        prepared = prepare_model(config)
    except Exception as exc:
        fail(exc, run_dir=config.run_dir)
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

    exit_on_sigterm()
    check_prefect()
    config = deploy_config(repo_id, options)
    if warning := config.exposure_warning():  # vLLM beyond loopback with no API key: said before anything runs
        typer.echo(f"warning: {warning}", err=True)
    check_before_the_flow(config)
    try:
        result = deploy_model(config)
    except Exception as exc:
        fail(exc, run_dir=config.run_dir)
    if (answers := result.record.answers) is not None:
        typer.echo(f"answer check passed: {answers.accuracy:.0%} of {len(answers.outputs)} probes right")
    print_table(result.results, result.sweep_end)
    if result.record.compared:
        typer.echo(f"\nregression gate: {result.record.compared}")
    if result.base_url:
        typer.echo(f"\nserving {config.served_model_name or config.repo_id}@{result.prepared.commit[:12]} at "
                   f"{result.base_url}/v1")


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

    exit_on_sigterm()
    check_prefect()
    deploy = deploy_config(repo_id, options)
    check_models_root(deploy.models_root)
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
    check_hub(deploy.repo_id, deploy.revision, deploy.hub_endpoint)
    try:
        results = tune_model(config)
    except Exception as exc:
        fail(exc)
    import pandas as pd

    from tasks.tuning.measure import winner
    from tasks.tuning.report import tuning_rows

    with pd.option_context("display.width", 250, "display.max_columns", None, "display.max_colwidth", 60):
        rows = [{k: "-" if v is None else v for k, v in row.items()} for row in tuning_rows(results)]
        typer.echo(pd.DataFrame(rows).to_string(index=False))
    best = winner(results, config.winner_rule)
    if best is None:
        typer.echo("\nerror: no winner: no candidate was measured (each one's cause is in the table)", err=True)
        raise typer.Exit(1)
    typer.echo(f"\nwinner: {best.name}" + (" (promoted: the next deploy of this model here uses it)" if promote
                                           else ""))

"""`rollout bench` and `history`: measure any OpenAI-compatible server, and read the runs back."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from flows.cli.common import (
    LOAD,
    REPO_ID,
    app,
    from_options,
    print_table,
)
from flows.cli.options import with_options
from tasks.errors import BenchConfigError

if TYPE_CHECKING:
    from tasks.bench.results import LevelResult


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
    from tasks.names import model_slug
    from tasks.serving import Serving

    if max_concurrency:
        options["concurrency_levels"] = ",".join(map(str, geometric_levels(max_concurrency)))
    spec = from_options(LOAD, options)
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

    with Serving(base_url=base_url) as serving:  # a server someone else runs: never stopped here
        swept = serving.sweep(spec, level)
    facts = {"Server": base_url, "Load": spec.load}
    save_results(swept.rows, out, f"Benchmark of {model}", facts=facts, stop=swept.stop)
    typer.echo("")
    print_table(swept.rows, swept.stop)
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

    from tasks.history.runs import comparison, newest_regressed, readable
    from tasks.orchestration.history import read_history

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
    regressed = newest_regressed(table)
    for row in regressed.itertuples():
        typer.echo(f"regression: {row.model} at {row.revision}: {row.regression}")
    raise typer.Exit(1 if len(regressed) else 0)

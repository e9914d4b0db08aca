"""CLI options generated from the pydantic models, so each setting is declared once.

A field's name becomes its flag (`tensor_parallel_size` -> `--tensor-parallel-size`), its
description the help, its default the default (a bool becomes `--flag/--no-flag`); a few
flags keep a short alias (`--tp`). `rollout deploy --help` thus lists the same settings as the
Prefect form, and a field added to VllmSettings or BenchSpec is on the command line at once.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Optional

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo

# Short or established names, kept beside the generated ones (the first one names the flag in errors).
ALIASES: dict[str, tuple[str, ...]] = {
    "tensor_parallel_size": ("--tensor-parallel-size", "--tp"),
    "enable_expert_parallel": ("--enable-expert-parallel/--no-enable-expert-parallel", "--ep/--no-ep"),
    "extra_args": ("--vllm-arg",),
    "hub_endpoint": ("--endpoint",),
    "pinned_models": ("--pin",),
    "concurrency_levels": ("--concurrency",),
    "min_throughput_gain": ("--min-gain", "--min-throughput-gain"),
    "evict": ("--evict/--dry-run",),
    "keep_serving": ("--keep-serving/--stop-after-bench",),
    "answers_enabled": ("--answers/--no-answers",),
}


class BadOption(ValueError):
    """A value the command line cannot turn into the field's type; the message names the flag."""


@dataclass
class Group:
    """One model's fields as options; `only` or `skip` pick the fields. `defaults`, an instance of
    the model, supplies the defaults where a form's default differs from the model's own. `prefix`
    goes before each field's flag, for a model whose field names would collide with another's or
    say nothing alone (`--answers-probes`, not `--probes`)."""

    model: type[BaseModel]
    panel: str  # the heading `--help` lists the group's options under
    only: Iterable[str] | None = None
    skip: Iterable[str] = ()
    defaults: BaseModel | None = None
    prefix: str = ""

    def default(self, name: str) -> Any:
        if self.defaults is not None:
            return getattr(self.defaults, name)
        info = self.model.model_fields[name]
        return None if info.is_required() else info.get_default(call_default_factory=True)

    def fields(self) -> dict[str, FieldInfo]:
        names = self.only if self.only is not None else self.model.model_fields
        return {n: self.model.model_fields[n] for n in names if n not in set(self.skip)}

    def values(self, options: dict[str, Any]) -> dict[str, Any]:
        """This group's fields from the command's options, in the field's type; unset ones left out."""
        out = {}
        for name, info in self.fields().items():
            value = options[self.prefix + name]
            if value is None and _listish(info):
                continue  # a repeatable option not given: the model's own default
            out[name] = _parse(self.prefix + name, info, value)
        return out


def _decls(name: str) -> tuple[str, ...]:
    return ALIASES.get(name, (f"--{name.replace('_', '-')}",))


def flag(name: str, argv: list[str] | None = None) -> str:
    """The field's flag as the command line in `argv` spelled it (`--tp`, where it was typed so), else
    its first spelling (`--tensor-parallel-size`)."""
    spellings = [spelling for decl in _decls(name) for spelling in decl.split("/")]
    typed = {arg.split("=")[0] for arg in argv or ()}
    return next((s for s in spellings if s in typed), spellings[0])


def _optional(annotation) -> tuple[Any, bool]:
    """(the type inside `X | None`, its constraints (Annotated) left to pydantic, whether None was allowed)."""
    args, nullable = typing.get_args(annotation), False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        (annotation,) = [a for a in args if a is not type(None)]
        nullable = True
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation, nullable


def _listish(info: FieldInfo) -> bool:
    return typing.get_origin(_optional(info.annotation)[0]) in (list, dict)


def _cli_type(info: FieldInfo, default: Any) -> tuple[Any, Any]:
    """(the type typer parses, the option's default) for a field."""
    inner, nullable = _optional(info.annotation)
    origin = typing.get_origin(inner)
    if origin is list and typing.get_args(inner) == (int,):
        return str, ",".join(map(str, default)) if default else None  # --concurrency 1,2,4
    if origin in (list, dict):
        return Optional[list[str]], None  # repeatable; a dict's items as KEY=VALUE
    return (Optional[inner] if nullable or default is None else inner), default


def _parse(name: str, info: FieldInfo, value: Any) -> Any:
    inner, _ = _optional(info.annotation)
    origin = typing.get_origin(inner)
    if value is None or origin not in (list, dict):
        return value
    if origin is dict:
        pairs = [item.partition("=") for item in value]
        if bad := [item for item, (_, eq, _) in zip(value, pairs) if not eq]:
            raise BadOption(f"bad option {flag(name)} {bad[0]!r}: expected KEY=VALUE")
        return {k: v for k, _, v in pairs}
    if typing.get_args(inner) == (int,):
        try:
            return [int(c) for c in value.split(",") if c.strip()]
        except ValueError as exc:
            raise BadOption(f"bad option {flag(name)} {value!r}: {exc}") from exc
    return value


def _parameter(name: str, info: FieldInfo, default: Any, panel: str) -> inspect.Parameter:
    cli_type, default = _cli_type(info, default)
    decls = _decls(name)
    if cli_type is bool and len(decls) == 1 and "/" not in decls[0]:
        decls = (f"{decls[0]}/--no-{decls[0][2:]}",)
    option = typer.Option(*decls, help=info.description, rich_help_panel=panel)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=Annotated[cli_type, option],
                             default=default)


def with_options(*groups: Group) -> Callable[[Callable], Callable]:
    """The command takes its own parameters plus every group's fields as keyword options."""

    def wrap(command: Callable) -> Callable:
        own = [p for p in inspect.signature(command, eval_str=True).parameters.values()
               if p.kind is not inspect.Parameter.VAR_KEYWORD]
        taken = {p.name for p in own}
        generated = [_parameter(group.prefix + name, info, group.default(name), group.panel)
                     for group in groups for name, info in group.fields().items() if group.prefix + name not in taken]

        @functools.wraps(command)
        def run(**options):
            return command(**options)

        run.__signature__ = inspect.Signature(own + generated)  # what typer reads
        return run

    return wrap

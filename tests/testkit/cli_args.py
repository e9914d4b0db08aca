"""A run form as the flags a user would type for it: tests drive the CLI with the same deployment a
Python test builds (`demo_config`), so both land on the same cache keys and history."""

from __future__ import annotations

from pydantic import BaseModel

from flows.cli import ANSWERS, ENGINE, FORM, LOAD
from flows.cli.options import _decls, flag
from tasks.deployment.config import DeployConfig


def _bool_flags(name: str) -> tuple[str, str]:
    decl = _decls(name)[0]
    on, _, off = decl.partition("/")
    return on, off or f"--no-{on[2:]}"


def cli_args(config: DeployConfig) -> list[str]:
    """The repo id, then one flag per field that differs from the command's default."""
    args = [config.repo_id]
    groups: list[tuple[object, BaseModel]] = [(FORM, config), (ENGINE, config.vllm), (LOAD, config.bench),
                                               (ANSWERS, config.answers)]
    for group, model in groups:
        for name, _info in group.fields().items():
            value, default = getattr(model, name), group.default(name)
            if value == default:
                continue
            option = group.prefix + name
            if value is None:
                raise ValueError(f"{option}: the command line cannot unset a default ({default!r})")
            if isinstance(value, bool):
                args.append(_bool_flags(option)[0 if value else 1])
            elif isinstance(value, list) and all(isinstance(v, int) for v in value):
                args += [flag(option), ",".join(map(str, value))]
            elif isinstance(value, list):
                for item in value:
                    args += [flag(option), str(item)]
            elif isinstance(value, dict):
                for key, item in value.items():
                    args += [flag(option), f"{key}={item}"]
            else:
                args += [flag(option), str(value)]
    return args

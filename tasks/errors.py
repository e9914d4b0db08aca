"""The project's errors, one base class: each carries the exit code its command ends with, and its
message names what to fix, so the CLI prints one line and a flow's failure reads the same."""

from __future__ import annotations


class RolloutError(RuntimeError):
    """A failure the user can act on; `exit_code` is what the CLI exits with (1: the check failed)."""

    exit_code = 1


class UnusableInput(RolloutError):
    """Nothing could be checked: a bad name, an endpoint that does not answer (exit 2)."""

    exit_code = 2


def first_line(err: BaseException) -> str:
    """`Type: first line of the message`: what a log line, an artifact and the CLI show of an error."""
    text = str(err).splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"

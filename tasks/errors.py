"""Every error the project raises on purpose, under one base class.

Each carries the exit code its command ends with, and a message that names the file, field,
endpoint or fix, so the CLI prints one line and a flow's failure reads the same in the UI.
"""

from __future__ import annotations


class RolloutError(RuntimeError):
    """A failure the user can act on; `exit_code` is what the CLI exits with (1: a check failed)."""

    exit_code = 1
    stage = "the deploy"  # the pipeline step it stops, as a run's summary names it ("failed at the answer check")


class UnusableInput(RolloutError):
    """Nothing could be checked: a bad name or file, an endpoint that does not answer (exit 2)."""

    exit_code = 2


# Hub
class HubError(UnusableInput):
    """A hub answer that retrying cannot change (missing repo, revision or file, no access)."""

    stage = "the hub"


class HubUnreachable(UnusableInput):
    """No HTTP answer at all: refused, unresolved name, TLS failure or timeout. Worth retrying in a
    flow (a hub outage passes), but named in one line: a typo in the endpoint looks just like this."""

    stage = "the hub"


class ChecksumError(RolloutError):
    """Downloaded bytes differ from what the hub published; the partial file was deleted."""

    stage = "the fetch"


class IncompleteDownload(RolloutError):
    """The stream ended short of the file's size; the bytes so far stay for the next try to resume."""

    stage = "the fetch"


# Disk
class DiskSpaceError(RolloutError):
    """The model will not fit on the models filesystem, or deleting did not free what it should."""

    stage = "the disk plan"


# Checkpoint
class CheckpointError(UnusableInput, ValueError):
    """The checkpoint cannot be read at all (missing dir, bad JSON, hostile or broken header)."""

    stage = "the checkpoint validation"


class ValidationFailed(RolloutError):
    """The checkpoint does not store what its quantization config says."""

    stage = "the checkpoint validation"


# GPUs and vLLM
class GpuConfigError(RolloutError):
    """The deployment cannot run on this host's GPUs."""

    stage = "the hardware check"


class HostBusyError(RolloutError):
    """Another deploy holds this host's GPUs."""

    stage = "the host lock"


class ServerStartError(RolloutError):
    """vLLM did not become ready; `cause` is a stable id, `log_tail` the last lines it wrote, `next_step`
    what to change before the next try (empty where nothing better than the message can be said)."""

    stage = "the vLLM start"

    def __init__(self, message: str, cause: str, log_tail: str, next_step: str = ""):
        super().__init__(message)
        self.cause = cause
        self.log_tail = log_tail
        self.next_step = next_step


# Benchmark
class BenchConfigError(UnusableInput, ValueError):
    """The benchmark cannot build its prompts from what it was given."""

    stage = "the benchmark"


class AnswerCheckFailed(RolloutError):
    """The new server answers its probes wrong, degenerately, or worse than the last good deployment."""

    stage = "the answer check"


class FilesChanged(AnswerCheckFailed):
    """The new revision's files change what the same weights mean (vocabulary, config): refused
    before the swap, so the last good deployment never stopped."""

    stage = "the comparison of its files with the last good deployment's, before the swap"


class BenchmarkFailed(RolloutError):
    """Every request of a benchmark level failed: the server refuses the load or died under it, and
    a deployment nobody can use is no last good one."""

    stage = "the benchmark"


class ServerDied(RolloutError):
    """The server died while it was checked or benchmarked: the death (exit code or signal) is the
    cause, and what the client saw ("every request failed ...: ReadError") only its symptom."""

    stage = "the server"

    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message)
        self.log_tail = log_tail


class RegressionError(RolloutError):
    """A run benchmarks worse than the last good run of the same model on the same GPUs, beyond the
    allowed threshold."""

    stage = "the regression gate"


# Fleet
class HostUnreachable(RolloutError):
    """A host's deployment could not run there: it is not registered, or no worker picked its run up."""

    stage = "the hand-over to the host's worker"


class FleetRolloutFailed(RolloutError):
    """A host of a fleet rollout did not end serving the new revision; the hosts after it were left
    as they were."""

    stage = "the fleet rollout"


def first_line(err: BaseException) -> str:
    """`Type: first line of the message`: what a log line, an artifact and the CLI show of an error."""
    text = str(err).splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def failed_stage(err: BaseException) -> str:
    """The step a failure stopped, in words: the project's own errors say; anything else is unforeseen."""
    if isinstance(err, RolloutError):
        return err.stage
    # Prefect's own signal exceptions (TerminationSignal, a cancel) derive from its ExternalSignal.
    interrupted = isinstance(err, (KeyboardInterrupt, SystemExit)) or any(
        cls.__name__ == "ExternalSignal" for cls in type(err).__mro__)
    return "an interruption (SIGTERM, Ctrl-C or a cancel)" if interrupted else "an unexpected error"

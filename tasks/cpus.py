"""CPU lists as taskset writes them ('0-2,5'): where the server and the benchmark client may run.

On a CPU host the two share the machine, and a client that waits for the server's core measures
the scheduler; each gets its own CPUs instead. One type for both forms, one parser for both.
"""

from __future__ import annotations

import os
from typing import Annotated

from pydantic import StringConstraints

CpuList = Annotated[str, StringConstraints(pattern=r"^\d+(-\d+)?(,\d+(-\d+)?)*$")]


def parse_cpus(cpus: str | None) -> set[int] | None:
    """'0-2,5' as {0, 1, 2, 5}; None stays None (any CPU)."""
    if cpus is None:
        return None
    found: set[int] = set()
    for part in cpus.split(","):
        low, _, high = part.partition("-")
        found.update(range(int(low), int(high or low) + 1))
    return found


def server_and_client_cpus() -> tuple[CpuList | None, CpuList | None]:
    """Every usable core but the last for the server, the last for the client; (None, None) on one
    core, where there is nothing to split."""
    cores = sorted(os.sched_getaffinity(0))
    return (",".join(map(str, cores[:-1])), str(cores[-1])) if len(cores) > 1 else (None, None)

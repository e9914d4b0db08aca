"""This host's name: what its runs, its history records and its deploy lock are named after.

The machine's hostname, unless ROLLOUT_HOST says otherwise. A fleet's generated deployments set it
per host (deployments/hosts.yaml), so two "hosts" that share a machine, as the fleet test's do, or
a host whose hostname is a pod's, still each have their own name, history and lock.
"""

from __future__ import annotations

import os
import socket

HOST_ENV = "ROLLOUT_HOST"


def host_name() -> str:
    return os.environ.get(HOST_ENV) or socket.gethostname()

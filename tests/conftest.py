"""Shared fixtures: one Prefect test server, tiny checkpoints and a local Hub per session."""

from __future__ import annotations

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from flows.demo import build_demo_repos  # noqa: E402
from flows.demo.hub_server import LocalHub  # noqa: E402


@pytest.fixture(scope="session")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(scope="session")
def hub_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hub")
    build_demo_repos(root)
    return root


@pytest.fixture(scope="session")
def local_hub(hub_root):
    with LocalHub(hub_root) as hub:
        yield hub

"""docker/: the compose stack and worker image agree with each other and with deployments/prefect.yaml.

No container engine here: the files are parsed and cross-checked; `docker compose config` runs too
where the compose plugin is installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker" / "compose.yaml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _prefect_yaml() -> dict:
    return yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())


def _first_host() -> dict:
    return yaml.safe_load((ROOT / "deployments" / "hosts.yaml").read_text())["hosts"][0]


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return [tuple(line.split(None, 1)) for line in text.splitlines() if line.strip() and not line.startswith("#")]


def test_the_server_runs_on_postgres_and_the_worker_on_the_deployments_pool_with_gpus_and_models():
    services = _compose()["services"]
    assert {"postgres", "prefect-server", "register", "worker"} <= set(services)
    pg = services["postgres"]["environment"]
    url = services["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    match = re.fullmatch(r"postgresql\+asyncpg://(\w+):(.+)@(\w[\w-]*):5432/(\w+)", url)
    assert match and match[1] == pg["POSTGRES_USER"] and match[2] == pg["POSTGRES_PASSWORD"]
    assert match[3] == "postgres" and match[4] == pg["POSTGRES_DB"]
    assert services["prefect-server"]["ports"] == ["4200:4200"]

    worker = services["worker"]
    pool = _first_host()["name"]
    command = dict(_instructions())["CMD"]
    assert f'"--pool", "{pool}"' in command and '"--type", "process"' in command
    assert f"create {pool} --type process" in " ".join(services["register"]["command"])
    assert re.search(r"http://127.0.0.1:4200/api}?$", worker["environment"]["PREFECT_API_URL"]) and worker["network_mode"] == "host"
    models_root = _first_host()["models_root"]
    assert any(v.endswith(f":{models_root}") for v in worker["volumes"])
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert worker["ipc"] == "host"


def test_every_dependency_names_a_service_and_every_named_volume_is_declared():
    compose = _compose()
    services = compose["services"]
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, (name, dependency)
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if not source.startswith(("/", ".", "$")):
                assert source in compose["volumes"], (name, source)
    built = [s for s in services.values() if "build" in s]
    assert len(built) == 1 and (COMPOSE.parent / built[0]["build"]["context"] / built[0]["build"]["dockerfile"]
                                ).resolve() == DOCKERFILE
    images = {s["image"] for s in services.values() if s.get("image", "").startswith("rollout-worker")}
    assert images == {built[0]["image"]}  # the registration job and the worker run the built image


def test_the_worker_image_is_vllms_openai_image_with_this_project_on_top():
    steps = _instructions()
    assert any(op == "FROM" and args.startswith("vllm/vllm-openai:") for op, args in steps)
    for op, args in steps:
        if op == "COPY":
            *sources, _ = args.split()
            for source in sources:
                assert (ROOT / source).exists(), source
    env = " ".join(args for op, args in steps if op == "ENV")
    assert "ROLLOUT_HOME=/opt/rollout" in env and ("WORKDIR", "/opt/rollout") in steps
    pull = _prefect_yaml()["pull"][0]["prefect.deployments.steps.set_working_directory"]["directory"]
    assert pull == "{{ $ROLLOUT_HOME }}"
    assert ("ENTRYPOINT", "[]") in steps  # the base image's `vllm serve` entrypoint is not the worker


TEST_SUPPORT = ("class Fault", "FaultyHub", "StreamingServer", "write_sparse_kimi", "testkit")


def test_neither_the_image_nor_the_installed_package_carries_test_support():
    from setuptools import find_packages

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packaged = [ROOT.joinpath(*package.split(".")) for package in find_packages(str(ROOT), include=include)]
    copied = [ROOT / source for op, args in _instructions() if op == "COPY" for source in args.split()[:-1]]
    assert packaged and not any("tests" in p.parts for p in packaged + copied)
    for folder in {p for p in packaged + copied if p.is_dir()}:
        for module in folder.glob("*.py"):
            text = module.read_text()
            assert not [name for name in TEST_SUPPORT if name in text], module


def test_docker_compose_accepts_the_file():
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no docker compose here; the file is parsed and cross-checked by the tests above")
    done = subprocess.run([docker, "compose", "-f", str(COMPOSE), "config", "--quiet"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr

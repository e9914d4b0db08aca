"""The house rules hold (pyproject.toml's import-linter contracts), and they would catch a breach."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = str(Path(sys.executable).parent / "lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess:
    # The checked tree goes first on the path, so grimp reads its modules, not the installed ones.
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([LINT, str(root / "pyproject.toml"), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_domain_code_imports_no_prefect_and_layers_hold():
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 kept, 0 broken" in done.stdout


@pytest.mark.parametrize("planted, broken", [
    ("from prefect import task", "tasks.disk -> prefect"),
    ("from tasks.orchestration import steps", "tasks.disk -> tasks.orchestration.steps"),
])
def test_a_domain_module_importing_prefect_or_the_orchestration_layer_breaks_the_contract(planted, broken, tmp_path):
    for name in ("tasks", "flows"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    disk = tmp_path / "tasks" / "disk.py"
    disk.write_text(disk.read_text().replace("from pydantic import BaseModel\n",
                                             f"from pydantic import BaseModel\n{planted}\n", 1))
    done = _lint(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "BROKEN" in done.stdout and broken in done.stdout, done.stdout

"""The house's signatures (issue 29): a public function takes at most three parameters by position,
the rest by keyword (`repo_id, *, ...` as huggingface_hub writes them), and no call in the product
passes more than four arguments by position. Read from the AST of flows/ and tasks/, so the check
runs in `make test` and needs nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_POSITIONAL_PARAMS = 3
MAX_POSITIONAL_ARGS = 4
# Callees whose signatures are variadic by design: a log line's arguments, an executor's, itertools'.
VARIADIC = {"debug", "info", "warning", "error", "exception", "print", "submit", "product", "option_context"}
# A model repo's own code, shipped as the model's files: its overrides keep transformers' signatures.
MODEL_FILES = ROOT / "flows" / "demo" / "kimi_files"


def overflows(source: str, where: str) -> list[str]:
    """Every public def with more than three positional parameters and every call with more than four
    positional arguments in `source`, as "where:line name"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            positional = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
            if len(positional) > MAX_POSITIONAL_PARAMS:
                found.append(f"{where}:{node.lineno} def {node.name}({', '.join(positional)})")
        elif isinstance(node, ast.Call):
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if len(node.args) > MAX_POSITIONAL_ARGS and name not in VARIADIC:
                found.append(f"{where}:{node.lineno} call {name} with {len(node.args)} positional arguments")
    return found


def test_public_functions_take_at_most_three_positional_parameters_and_calls_at_most_four():
    found = [line for path in sorted((ROOT / "flows").rglob("*.py")) + sorted((ROOT / "tasks").rglob("*.py"))
             if MODEL_FILES not in path.parents for line in overflows(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == []


def test_the_check_finds_a_planted_signature_and_call():
    planted = '''
def publish(repo_id, results, facts, stop):
    return repo_id

def _private(a, b, c, d, e):
    return _private(1, 2, 3, 4, 5)

def keyword_only(repo_id, results, facts, *, stop=None):
    logger.info("%s %s %s %s %s", 1, 2, 3, 4)
    return keyword_only(1, 2, 3, stop=4)
'''
    assert overflows(planted, "planted.py") == ["planted.py:2 def publish(repo_id, results, facts, stop)",
                                                "planted.py:6 call _private with 5 positional arguments"]

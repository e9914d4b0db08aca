"""A revision that talks nonsense is never promoted: the nightly deploys it, the answer check fails
with its figures, and the last good deployment serves again (real vLLM CPU servers)."""

from __future__ import annotations

import shutil
import uuid

import httpx
import pytest
from conftest import artifact, vllm_processes

from flows.demo import BF16_REPO, demo_config
from flows.nightly import nightly_refresh
from tasks.artifacts import model_slug, read_history
from tasks.errors import AnswerCheckFailed
from tasks.history.last_good import read_last_good
from tasks.vllm.process import reap_stale

pytestmark = pytest.mark.usefixtures("prefect_server")
# No regression gate: this test is about answers, and two runs on shared cores differ by 25% or more.
QUICK = dict(concurrency_levels=[1, 2], requests_per_level=4, keep_serving=True, max_regression=None)


def _publish(repo, change) -> None:
    """A new commit of the repo: its weights changed by `change` (tensors in place)."""
    from safetensors.torch import load_file, save_file

    weights = repo / "model.safetensors"
    tensors = load_file(weights)
    change(tensors)
    save_file(tensors, weights, metadata={"format": "pt"})


def _answer(base_url: str, model: str, prompt: str) -> str:
    reply = httpx.post(f"{base_url}/v1/completions", timeout=60,
                       json={"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0}).json()
    return reply["choices"][0]["text"]


# Two ways to break it, one after the other against the same good deployment: no logits at all
# (every output empty), and every token read as another (wrong answers). Negating one layer's routed
# experts does not do it: counting lives in the shared paths.
DAMAGES = ("lm_head zeroed", "embeddings shuffled")


def _damage(name: str):
    def damaged(tensors):
        import torch

        if name == "lm_head zeroed":
            tensors["lm_head.weight"] = torch.zeros_like(tensors["lm_head.weight"])
        else:
            rows = tensors["model.embed_tokens.weight"]
            tensors["model.embed_tokens.weight"] = rows[torch.randperm(len(rows),
                                                                      generator=torch.Generator().manual_seed(0))]
    return damaged


def test_a_damaged_revision_fails_the_answer_check_and_the_good_one_serves_again(hub_root, local_hub, tmp_path):
    repo_id = f"answers-{uuid.uuid4().hex[:6]}/tiny-moe"
    repo = hub_root / repo_id
    shutil.copytree(hub_root / BF16_REPO, repo)
    original = (repo / "model.safetensors").read_bytes()
    local_hub.refresh()
    config = demo_config(local_hub.endpoint, tmp_path / "models", repo_id=repo_id, **QUICK)
    state = config.run_dir / "server.json"
    try:
        nightly_refresh(config)  # the first deployment: judged on the absolute checks alone
        good = read_last_good(config.run_dir)
        base_url = f"http://127.0.0.1:{good.server.port}"
        assert good.record.answers.accuracy >= 0.9 and _answer(base_url, repo_id, "41 42 43") == " 44 45 46"

        for damage in DAMAGES:
            (repo / "model.safetensors").write_bytes(original)
            _publish(repo, _damage(damage))
            local_hub.refresh()
            with pytest.raises(AnswerCheckFailed, match="accuracy"):
                nightly_refresh(config)
            answers = artifact(f"answers-{model_slug(repo_id)}").data
            assert answers.startswith("# Answer check: FAILED") and "accuracy 0% below 80%" in answers, damage
            assert f"(last good: {good.record.answers.accuracy:.0%})" in answers  # drift figures beside the new
            assert "| `42 43 44` | ` 45 46 47` | " in answers and "| ` 45 46 47 48 49 50` | no |" in answers
            back = read_last_good(config.run_dir)
            assert back.commit == good.commit  # the good deployment serves again, at the same address
            assert _answer(base_url, repo_id, "41 42 43") == " 44 45 46"
            assert "AnswerCheckFailed" in artifact(f"rollback-{model_slug(repo_id)}").data
            summary = artifact(f"deploy-{model_slug(repo_id)}").data.splitlines()[0]
            assert summary.startswith(f"# Rolled back: {repo_id}@") and "failed at the answer check" in summary
        assert [r.status for r in read_history(repo_id)] == ["passed", "failed", "failed"]
        # A legitimate re-publish (the same weights under a new commit) passing the drift checks
        # against the last good deployment: tests/test_fleet.py, its third rollout.
    finally:
        reap_stale(state)
        shutil.rmtree(repo, ignore_errors=True)
        local_hub.refresh()
    assert vllm_processes() == []

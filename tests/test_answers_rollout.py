"""A revision that talks nonsense is never promoted: the nightly deploys it, a check named for the
damage fails it, and the last good deployment serves (real vLLM CPU servers). Damage in the files
(tokenizer, config) is refused before the swap; damage only a server shows (a chat template that
loses the user's message, routed experts scaled, positions read differently, no logits) fails the
answer check and the last good one is restored. The demo model's cycle probes are what see the
experts and the positions: its counting probes stay right under both."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from conftest import artifact, vllm_processes

from flows.demo import BF16_REPO, demo_config
from flows.deploy import deploy_model
from flows.nightly import nightly_refresh
from tasks.errors import AnswerCheckFailed, FilesChanged
from tasks.history.last_good import read_last_good
from tasks.names import model_slug
from tasks.orchestration.history import read_history
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


def _chat(base_url: str, model: str, content: str) -> str:
    reply = httpx.post(f"{base_url}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 3, "temperature": 0}).json()
    return reply["choices"][0]["message"]["content"]


def _answer(base_url: str, model: str, prompt: str, max_tokens: int = 3, timeout: float = 60) -> str:
    reply = httpx.post(f"{base_url}/v1/completions", timeout=timeout,
                       json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).json()
    return reply["choices"][0]["text"]


def _unavailable_s(summary: str) -> float:
    """The swap's gap as the deploy summary states it."""
    return float(summary.split("**Unavailable during the swap:** ")[1].split(" s ")[0])


def _swap_tokens(repo, a: str = "Ġ44", b: str = "Ġ47") -> None:
    """The tokenizer under the weights changed: two number tokens exchange their ids."""
    path = repo / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(data))


def _rope_times_1000(repo) -> None:
    """config.json alone changed: the same weights read positions differently."""
    path = repo / "config.json"
    config = json.loads(path.read_text())
    rope = config["rope_parameters"] if "rope_parameters" in config else config  # transformers 5 nests it
    rope["rope_theta"] = rope.get("rope_theta", 10000.0) * 1000
    path.write_text(json.dumps(config, indent=2))


def _routed_experts_x8(repo) -> None:
    """Every routed expert's gate and up projections scaled 8x: the shared expert and attention intact."""
    _publish(repo, lambda tensors: tensors.update({name: t * 8 for name, t in tensors.items() if ".mlp.experts." in name
                                                   and ("gate_proj" in name or "up_proj" in name)}))


def _wrong_by_completion(answers: str) -> list[str]:
    """The prompts the answers artifact marks wrong, asked by completion."""
    return [row.split(" | ")[1].strip("`") for row in answers.splitlines()
            if row.startswith("| completion |") and row.endswith("| no |")]


def _counting(prompt: str) -> bool:
    numbers = [int(n) for n in prompt.split()]
    return all(b == a + 1 for a, b in zip(numbers, numbers[1:]))


def _template_drops_the_user(repo) -> None:
    """A chat template that loses the user's message: completions stay right, chat answers do not."""
    (repo / "chat_template.jinja").write_text("{{ '20 21 22' }}")


def _lm_head_zeroed(repo) -> None:
    """No logits at all: every output empty."""
    _publish(repo, lambda tensors: tensors.update(lm_head_weight_zeroed(tensors)))


def lm_head_weight_zeroed(tensors):
    import torch

    return {"lm_head.weight": torch.zeros_like(tensors["lm_head.weight"])}


class Client:
    """A user of the host: asks "41 42 43" every 0.1 s at the host's one address, and notes when it
    was answered right ("44" first), as the swap's gap is defined from a client's side. Every request
    is kept (sent, answered, what came back), to be read against the product's own probes."""

    def __init__(self, base_url: str, model: str):
        self.base_url, self.model, self.right, self.requests = base_url, model, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> "Client":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.wait(0.1):
            sent = time.time()
            try:
                said = repr(_answer(self.base_url, self.model, "41 42 43", max_tokens=1, timeout=2))
            except (httpx.HTTPError, KeyError, ValueError) as err:
                said = type(err).__name__
            self.requests.append((sent, time.time(), said))
            if said == repr(" 44"):
                self.right.append(time.time())

    def longest_gap(self, since: float) -> float:
        times = [t for t in self.right if t >= since]
        return max(b - a for a, b in zip(times, times[1:]))

    def agrees(self, since: float, recorded: float, probes: Path) -> tuple[bool, str]:
        """Whether the longest gap this client saw is the recorded one within 1 s; where not, both
        timelines (what each request got, where it changed), to say which of the two lagged."""
        seen = self.longest_gap(since)
        if abs(seen - recorded) < 1.0:
            return True, ""

        def changes(rows) -> list[str]:
            out, last = [], None
            for sent, at, said in rows:
                if said != last:
                    out.append(f"{time.strftime('%H:%M:%S', time.gmtime(sent))}.{int(sent % 1 * 1000):03d}"
                               f"+{at - sent:.2f}s {said}")
                    last = said
            return out
        probe_rows = [(r["sent"], r["at"], f"{r['pgid']}:{r['outcome']}")
                      for r in map(json.loads, probes.read_text().splitlines())] if probes.exists() else []
        return False, (f"client saw {seen:.1f} s, the run recorded {recorded:.1f} s\nclient:\n  "
                       + "\n  ".join(changes(self.requests)) + "\nprobe:\n  " + "\n  ".join(changes(probe_rows)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_damaged_revisions_are_caught_by_the_check_named_and_the_good_one_serves_again(hub_root, local_hub, tmp_path):
    repo_id = f"answers-{uuid.uuid4().hex[:6]}/tiny-moe"
    repo = hub_root / repo_id
    shutil.copytree(hub_root / BF16_REPO, repo)
    local_hub.refresh()
    # One address for the host, as its clients know it: every server of the test listens there.
    config = demo_config(local_hub.endpoint, tmp_path / "models", repo_id=repo_id, port=_free_port(), prestart=True,
                         **QUICK)
    state = config.run_dir / "server.json"

    def plant(damage) -> None:
        shutil.rmtree(repo)
        shutil.copytree(hub_root / BF16_REPO, repo)
        damage(repo)
        local_hub.refresh()

    try:
        nightly_refresh(config)  # the first deployment: judged on the absolute checks alone
        good = read_last_good(config.run_dir)
        base_url = f"http://127.0.0.1:{good.server.port}"
        assert good.record.answers.accuracy >= 0.9 and _answer(base_url, repo_id, "41 42 43") == " 44 45 46"
        assert _chat(base_url, repo_id, "41 42 43") == " 44 45 46"  # the demo model ships a chat template
        # torch.compile's cache on the models disk: a restore of this launch finds its graphs there.
        assert good.server.env["VLLM_CACHE_ROOT"] == str(config.run_dir / "vllm-cache")

        # Caught in the files, before the swap: the good server never stops (same process group).
        for damage, named in ((_swap_tokens, "tokenizer: the ids of 2 tokens changed: 'Ġ47' 353 -> 364, "
                                             "'Ġ44' 364 -> 353"),
                              (_rope_times_1000, "rope_theta 10000.0 -> 10000000.0")):
            plant(damage)
            with pytest.raises(FilesChanged, match="before the swap|under weights of the same shapes|"
                                                   "the same weight files, computed differently"):
                nightly_refresh(config)
            files = artifact(f"files-{model_slug(repo_id)}").data
            assert files.startswith("# Files against the last good deployment: FAILED") and named in files, files
            assert read_last_good(config.run_dir).serving_pgid == good.serving_pgid
            summary = artifact(f"deploy-{model_slug(repo_id)}").data.splitlines()[0]
            assert summary.startswith(f"# Failed: {repo_id}@") and summary.endswith("keeps serving"), summary

        # Caught by the server's answers, after the swap: the good deployment is restored. A client
        # asking throughout sees the swap's gap as the run recorded it, to within 1 s: from the good
        # server's last answer to the restored one's first (the zeroed lm_head's answers are empty;
        # the broken template's server answers completions right, so its client saw two gaps).
        # The experts and the positions: only the cycle probes go wrong (below the 80% floor, and
        # flipped from right against the last good deployment). The rope change gets past the files'
        # check only because this run says the files' changes are meant: it reaches the probes.
        meant = config.model_copy(update={"answers": config.answers.model_copy(update={"allow_changed_files": True})})
        for damage, problem, form in (
                (_template_drops_the_user, "probes right for the last good deployment are wrong now", config),
                (_routed_experts_x8, "flipped from right to wrong", config),
                (_rope_times_1000, "right for the last good deployment are wrong now, under the same weights", meant),
                (_lm_head_zeroed, "accuracy 0% below 80%", config)):
            plant(damage)
            with Client(base_url, repo_id) as client, pytest.raises(AnswerCheckFailed, match=problem):
                started = time.time()
                nightly_refresh(form)
            recorded = _unavailable_s(artifact(f"deploy-{model_slug(repo_id)}").data)
            if damage is _lm_head_zeroed:
                agreed, timelines = client.agrees(started, recorded, config.run_dir / "gap-probe.jsonl")
                assert agreed, timelines
            answers = artifact(f"answers-{model_slug(repo_id)}").data
            assert answers.startswith("# Answer check: FAILED") and problem in answers, damage
            assert f"(last good: {good.record.answers.accuracy:.0%})" in answers  # drift figures beside the new
            if damage in (_routed_experts_x8, _rope_times_1000):
                assert "accuracy" in answers and "below 80%" in answers, answers
                wrong = _wrong_by_completion(answers)
                assert len(wrong) >= 8 and not any(_counting(prompt) for prompt in wrong), wrong
            if damage is _rope_times_1000:  # named in the files, and let through as meant
                assert "rope_theta 10000.0 -> 10000000.0" in artifact(f"files-{model_slug(repo_id)}").data
            if damage is _template_drops_the_user:  # completions right, chat answers from "20 21 22"
                assert "| completion | `42 43 44` | ` 45 46 47` | ` 45 46 47" in answers
                assert "| chat | `42 43 44` | ` 45 46 47` | ` 23 24 25" in answers, answers
            back = read_last_good(config.run_dir)
            assert back.commit == good.commit  # the good deployment serves again, at the same address
            assert _answer(base_url, repo_id, "41 42 43") == " 44 45 46"
            assert "AnswerCheckFailed" in artifact(f"rollback-{model_slug(repo_id)}").data
            summary = artifact(f"deploy-{model_slug(repo_id)}").data.splitlines()[0]
            assert summary.startswith(f"# Rolled back: {repo_id}@") and "failed at the answer check" in summary

        # A re-publish of the same weights (a new commit: a README added) passes every check.
        plant(lambda r: (r / "README.md").write_text("Re-published, same weights.\n"))
        with Client(base_url, repo_id) as client:
            started = time.time()
            nightly_refresh(config)
            time.sleep(0.5)
        assert read_last_good(config.run_dir).commit != good.commit
        recorded = read_history(repo_id)[-1].unavailable_s  # in `rollout history` as "down s"
        assert recorded == pytest.approx(_unavailable_s(artifact(f"deploy-{model_slug(repo_id)}").data), abs=0.1)
        agreed, timelines = client.agrees(started, recorded, config.run_dir / "gap-probe.jsonl")
        assert agreed, timelines
        assert "Nothing changed." in artifact(f"files-{model_slug(repo_id)}").data
        # Its vLLM was launched while the good one still answered, held at its gate until the stop.
        assert "vllm.entrypoints.openai.api_server imported; waiting at" in (config.run_dir / "vllm.log").read_text()

        # An unchanged redeploy (the same commit, from the form) passes: greedy answers of the same
        # weights do not move, so no probe flips and no output changes. (Once: the re-publish above is
        # the other passing redeploy of these weights; a second one here cost a minute of the suite.)
        deploy_model(config)
        answers = artifact(f"answers-{model_slug(repo_id)}").data
        assert answers.startswith("# Answer check: passed"), answers
        rows = [row.split(" | ") for row in answers.splitlines() if row.startswith(("| completion |", "| chat |"))]
        assert len(rows) == 64 and all(row[3] == row[4] for row in rows), answers
        assert [r.status for r in read_history(repo_id)] == ["passed"] + ["failed"] * 4 + ["passed"] * 2
    finally:
        reap_stale(state)
        shutil.rmtree(repo, ignore_errors=True)
        local_hub.refresh()
    assert vllm_processes() == []

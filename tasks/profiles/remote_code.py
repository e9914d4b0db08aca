"""The code a model repo would have vLLM execute, and the operator's consent to it.

`--trust-remote-code` makes transformers import Python files from the model repo: a tokenizer
(Kimi's `tokenization_kimi.py`, a tiktoken BPE behind a PreTrainedTokenizer), a processor, a config
class. Whoever can publish a commit to the repo then runs code on the GPU host as the worker's
user. So it is decided from the repo's own files, said in one line, and never enabled silently:
- what would run is read from `auto_map` in config.json, tokenizer_config.json and the processor
  configs, before any download (the small JSON files only), and checked again on the files fetched;
- a tokenizer's auto_map is needed only where the repo has no tokenizer.json that transformers
  loads natively, and a config's only where vLLM has no class of its own for the family;
- the operator consents once per repo (`--trust-remote-code`, the form's checkbox), recorded in
  `<models_root>/.rollout/remote-code.json`; later runs of the repo (the nightly) go on with it. A
  new commit whose code differs is named by the files check and refused unless allowed.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel, Field

from tasks.errors import UnusableInput
from tasks.trust import read_state_text

# Where transformers reads an auto_map, and what each file's map loads.
AUTO_MAP_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")
MAX_JSON_BYTES = 16 * 1024 * 1024
CONSENT_FILE = "remote-code.json"
# "module.Class", or "other/repo--module.Class" (code from another repo).
_REFERENCE = re.compile(r"^(?:(?P<repo>[\w.-]+/[\w.-]+)--)?(?P<module>[\w.]+)\.(?P<cls>\w+)$")


class RemoteCodeRefused(UnusableInput):
    """A repo whose code vLLM would execute, with no consent given for it on this host."""

    stage = "the remote-code check"


class CodeEntry(BaseModel):
    file: str  # the JSON that names it
    key: str  # AutoTokenizer, AutoConfig, ...
    module: str  # tokenization_kimi.py, or other/repo:module.py
    needed: bool  # whether vLLM would run it (a native class does without)

    def text(self) -> str:
        return f"{self.module} ({self.file} auto_map {self.key})"


class RemoteCode(BaseModel):
    """What the repo's auto_maps name, and which of it `--trust-remote-code` would execute."""

    entries: list[CodeEntry] = Field(default_factory=list)

    @property
    def needed(self) -> list[CodeEntry]:
        return [e for e in self.entries if e.needed]

    @property
    def modules(self) -> list[str]:
        return sorted({e.module for e in self.needed})

    def text(self) -> str:
        return ", ".join(e.text() for e in self.needed)


def remote_code(files: dict[str, dict], *, has_fast_tokenizer: bool, native_config: bool) -> RemoteCode:
    """The auto_map entries of `files` (name -> parsed JSON), and which of them vLLM would need."""
    entries: list[CodeEntry] = []
    for name in AUTO_MAP_FILES:
        auto_map = (files.get(name) or {}).get("auto_map")
        if not isinstance(auto_map, dict):
            continue
        for key, value in auto_map.items():
            for reference in value if isinstance(value, list) else [value]:
                if not isinstance(reference, str) or not reference:
                    continue  # [slow, null]: no fast class named
                found = _REFERENCE.match(reference)
                module = (f"{found['repo']}:" if found and found["repo"] else "") + (
                    f"{found['module'].replace('.', '/')}.py" if found else reference[:120])
                needed = not ((name == "tokenizer_config.json" and has_fast_tokenizer)
                              or (name == "config.json" and native_config))
                entries.append(CodeEntry(file=name, key=str(key)[:60], module=module, needed=needed))
    return RemoteCode(entries=entries)


def local_files(model_dir: Path) -> dict[str, dict]:
    out = {}
    for name in AUTO_MAP_FILES:
        path = model_dir / name
        try:
            if path.stat().st_size <= MAX_JSON_BYTES:
                value = json.loads(path.read_text())
                out[name] = value if isinstance(value, dict) else {}
        except (OSError, ValueError):
            continue
    return out


class Consent(BaseModel):
    repo_id: str
    at: datetime
    commit: str
    modules: list[str]


def _consents(run_dir: Path) -> dict[str, Consent]:
    path = run_dir / CONSENT_FILE
    try:
        raw = json.loads(read_state_text(path))
        return {repo: Consent.model_validate(c) for repo, c in raw.items()} if isinstance(raw, dict) else {}
    except FileNotFoundError:
        return {}
    except ValueError as exc:  # damaged: no consent can be read from it, none is assumed
        raise UnusableInput(f"{path}: not a record of consents ({str(exc).splitlines()[0][:120]}): move it aside "
                            "and deploy once with --trust-remote-code") from exc


def consented(run_dir: Path, repo_id: str) -> Consent | None:
    return _consents(run_dir).get(repo_id)


def refusal(code: RemoteCode, *, repo_id: str, commit: str, run_dir: Path, given: bool) -> RemoteCodeRefused | None:
    """The refusal where code would run with no consent, given now or recorded; None where it may."""
    if not code.needed or given or consented(run_dir, repo_id) is not None:
        return None
    return RemoteCodeRefused(f"{repo_id}@{commit[:12]} ships code that vLLM would execute with --trust-remote-code: "
                             f"{code.text()}; read it, then deploy once with --trust-remote-code to consent for "
                             "this repo on this host")


def require_consent(code: RemoteCode, *, repo_id: str, commit: str, run_dir: Path, given: bool) -> str | None:
    """The one line the run logs about remote code, with consent recorded where `given` (the
    operator's --trust-remote-code) is new; RemoteCodeRefused where code would run unconsented."""
    if (refused := refusal(code, repo_id=repo_id, commit=commit, run_dir=run_dir, given=given)) is not None:
        raise refused
    if not code.needed:
        return None
    if (earlier := consented(run_dir, repo_id)) is not None:
        return (f"remote code: vLLM will execute {code.text()}, consented for {repo_id} on "
                f"{earlier.at:%Y-%m-%d %H:%M} UTC ({run_dir / CONSENT_FILE})")
    consents = _consents(run_dir)
    consents[repo_id] = Consent(repo_id=repo_id, at=datetime.now(timezone.utc), commit=commit, modules=code.modules)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONSENT_FILE).write_text(json.dumps({r: c.model_dump(mode="json") for r, c in consents.items()},
                                                   indent=2))
    return f"remote code: vLLM will execute {code.text()}; consent for {repo_id} recorded in {run_dir / CONSENT_FILE}"


def code_in_dir(model_dir: Path) -> RemoteCode:
    """What a fetched checkpoint would run (the consent was given on the hub's copy: checked again)."""
    from tasks.profiles.families import profile_for

    files = local_files(model_dir)
    profile = profile_for(files.get("config.json") or {})
    return remote_code(files, has_fast_tokenizer=(model_dir / "tokenizer.json").is_file(),
                       native_config=bool(profile and profile.native_config))


def code_in_snapshot(snapshot, endpoint: str | None) -> RemoteCode:
    """The same from the hub, before any download: the few small JSON files that hold an auto_map,
    each read to its published size and a bound (a hub that streams on is cut off there)."""
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    from tasks.hub import reaching
    from tasks.profiles.families import profile_for
    from tasks.trust import read_bounded

    sizes = {f.path: f.size for f in snapshot.files}
    files: dict[str, dict] = {}
    with reaching(endpoint):
        for name in AUTO_MAP_FILES:
            if name not in sizes or sizes[name] > MAX_JSON_BYTES:
                continue
            url = hf_hub_url(snapshot.repo_id, name, revision=snapshot.commit, endpoint=endpoint)
            with get_session().stream("GET", url, headers=build_hf_headers(), follow_redirects=True,
                                      timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as reply:
                hf_raise_for_status(reply)
                body = read_bounded(reply.iter_bytes(), limit=sizes[name],
                                    what=f"{snapshot.repo_id}@{snapshot.commit[:12]}: {name}")
            try:
                value = json.loads(body)
            except ValueError:
                continue  # validation names a broken config.json; nothing here can be read from it
            files[name] = value if isinstance(value, dict) else {}
    profile = profile_for(files.get("config.json") or {})
    return remote_code(files, has_fast_tokenizer="tokenizer.json" in sizes,
                       native_config=bool(profile and profile.native_config))

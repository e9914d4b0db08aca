"""A hostile hub and hostile model repos against the real front doors (`rollout validate`, `rollout
prepare`, and the fetch prepare runs), each in a subprocess: one line and its exit code, nothing
made outside the models root, and the process's peak memory far below what the attacker sent.

Every test here failed on the code before issue 38 (docs/security.md lists how). Each subprocess
runs under a deadline far above its normal second or two; hostile bodies stop at a few hundred MB.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from testkit.hostile_hub import Body, FakeRepo, HostileHub, Recorder, claimed_header

ROOT = Path(__file__).resolve().parents[1]
ROLLOUT = str(Path(sys.executable).with_name("rollout"))
MB = 2**20
# What the prepare flow does with a hub's answer, without Prefect: resolve, then fetch every file.
FETCH = """
import sys
from pathlib import Path
from tasks.errors import first_line
from tasks.hub import fetch_file, resolve_snapshot
endpoint, repo, cache = sys.argv[1], sys.argv[2], Path(sys.argv[3])
try:
    snap = resolve_snapshot(repo, "main", endpoint)
    for f in sorted(snap.files, key=lambda f: f.size):
        fetch_file(snap, f, cache, endpoint=endpoint)
except Exception as exc:
    print(f"error: {first_line(exc)}", file=sys.stderr)
    sys.exit(getattr(exc, "exit_code", 1))
"""


# Starts the command and reports its peak RSS. Not measured from the test itself: a child that
# pytest forks carries pytest's own high-water mark into its exec (Linux keeps the larger), and
# this small launcher's child starts from the launcher's few MB.
LAUNCHER = """
import os, resource, subprocess, sys
code = subprocess.call(sys.argv[2:])
with open(sys.argv[1], "w") as out:
    out.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.exit(code)
"""


@dataclass
class Ran:
    rc: int
    out: str
    err: str
    peak_mb: float  # the command's own peak resident memory (getrusage of its launcher's children)
    seconds: float


def run(cmd: list[str], *, timeout: float = 60, env: dict[str, str] | None = None) -> Ran:
    """The command to its end or its deadline (then killed, with its process group), and its peak RSS."""
    environ = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "ROLLOUT_MIRROR_TOKEN")}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile("r") as peak:
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, peak.name, *cmd], stdout=out, stderr=err, cwd=ROOT,
                                env={**environ, **(env or {})}, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # its own session: the launcher and the command
            proc.wait()
        seconds = time.monotonic() - started
        out.seek(0)
        err.seek(0)
        kb = peak.read().strip()
        ran = Ran(proc.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace"),
                  int(kb) / 1024 if kb else float("nan"), seconds)
    assert seconds < timeout, f"still running after {timeout} s: {ran}"
    return ran


def one_line(ran: Ran, *words: str) -> str:
    """The error is one line that says what it is about, and no traceback."""
    lines = ran.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), ran.err[-2000:]
    assert "Traceback" not in ran.err + ran.out
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def tree(top: Path, skip: Path) -> set[str]:
    """Every path under top (symlinks as links), the models root's own contents aside."""
    found = set()
    for folder, dirs, files in os.walk(top):
        if Path(folder) == skip or skip in Path(folder).parents:
            dirs[:] = []
            continue
        found |= {os.path.join(folder, n) for n in dirs + files}
    return found


@pytest.fixture(autouse=True)
def deadline():
    """Each test under 150 s, far above its few seconds (pytest-timeout is not installed here); the
    subprocesses have deadlines of their own."""
    def expired(*_):
        raise TimeoutError("the test ran past its 150 s deadline")

    before = signal.signal(signal.SIGALRM, expired)
    signal.alarm(150)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, before)


@pytest.fixture
def hostile(tmp_path):
    (tmp_path / "served").mkdir()
    with HostileHub(tmp_path / "served") as hub:
        yield hub


CONFIG = {"model_type": "tiny", "num_hidden_layers": 1}
SHARD = struct.pack("<Q", 26) + b'{"__metadata__":{"a":"b"}}'  # a header, no tensors


def honest(**changes) -> FakeRepo:
    files = {"config.json": Body.of(json.dumps(CONFIG).encode()), "model.safetensors": Body.of(SHARD)}
    return FakeRepo(files=files, **changes)


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_a_commit_sha_that_is_a_path_is_refused_and_nothing_is_made_outside_the_models_root(hostile, tmp_path,
                                                                                             where):
    victim = tmp_path / "victim"
    hostile.fake("org/lies", honest(commit="../../../../victim" if where == "relative" else str(victim)))
    root = tmp_path / "models"
    root.mkdir()
    before = tree(tmp_path, root)
    for cmd in ([sys.executable, "-c", FETCH, hostile.endpoint, "org/lies", str(root / "hub")],
                [ROLLOUT, "validate", "org/lies", "--endpoint", hostile.endpoint],
                [ROLLOUT, "prepare", "org/lies", "--endpoint", hostile.endpoint, "--models-root", str(root)]):
        ran = run(cmd, timeout=90)
        assert tree(tmp_path, root) == before and not victim.exists(), (cmd[1], tree(tmp_path, root) - before)
        assert ran.rc == 2, (cmd[1], ran)
        one_line(ran, "commit sha", hostile.endpoint, "not 40 lowercase hex")
        assert ran.peak_mb < 400, ran.peak_mb  # no body in this attack: what the command costs anyway


EVIL = hashlib.sha1(b"blob 4\0evil").hexdigest()  # the git blob id of the 4 bytes the hub serves for each


@pytest.mark.parametrize("entry, words", [
    ({"rfilename": "con\x00fig.json"}, ["control characters"]),
    ({"rfilename": "x" * 5000 + ".json"}, ["longer than 255 bytes"]),
    ({"rfilename": "model.safetensors/inner.json"}, ["as a file and as the folder"]),
    ({"rfilename": "config.json"}, ["listed twice"]),
    ({"rfilename": "evil.bin", "lfs": {"size": 4, "sha256": "../../../../victim", "pointerSize": 134}}, ["hash"]),
    ({"rfilename": "evil.txt", "blobId": "../../../victim"}, ["hash", "refused"]),
    ({"rfilename": "evil.txt", "size": -4}, ["size -4"]),
], ids=["nul", "5000-chars", "file-and-folder", "twice", "sha256-path", "blob-id-path", "negative-size"])
def test_names_hashes_and_sizes_that_no_cache_can_hold_are_refused_in_one_line(hostile, tmp_path, entry, words):
    entry = {"size": 4, "blobId": EVIL} | entry
    hostile.fake("org/names", honest(extra_siblings=[entry], unlisted={entry["rfilename"]: Body.of(b"evil")}))
    root = tmp_path / "models"
    root.mkdir()
    before = tree(tmp_path, root)
    ran = run([sys.executable, "-c", FETCH, hostile.endpoint, "org/names", str(root / "hub")])
    assert ran.rc == 2, ran
    one_line(ran, *words)
    assert tree(tmp_path, root) == before and not (tmp_path / "victim").exists()
    assert not [p for p in root.rglob("*")], "refused before anything was made, no stray link"


@pytest.mark.parametrize("announce", [False, True], ids=["until-closed", "announced"])
def test_a_body_past_its_published_size_is_cut_there_not_written_to_disk(hostile, tmp_path, announce):
    data = os.urandom(28_895)
    hostile.fake("org/endless", FakeRepo(files={"config.json": Body.of(data, runs_on=200 * MB, announce=announce)}))
    root = tmp_path / "models"
    ran = run([sys.executable, "-c", FETCH, hostile.endpoint, "org/endless", str(root / "hub")])
    assert hostile.sent["config.json"] < 20 * MB, "it stopped reading long before the 200 MB the hub had"
    assert ran.peak_mb < 120, ran.peak_mb
    assert not list(root.rglob("*.part")) and not list(root.rglob("snapshots/*/*"))
    assert ran.rc == 1, ran  # a ChecksumError: the bytes are not what was published, worth one retry
    one_line(ran, "config.json", "28,895 bytes", "published")


def test_an_api_answer_that_never_ends_is_read_to_a_bound(hostile, tmp_path):
    hostile.fake("org/endless", honest(api_runs_on=300 * MB))
    ran = run([ROLLOUT, "validate", "org/endless", "--endpoint", hostile.endpoint])
    assert hostile.sent["api"] < 100 * MB and ran.peak_mb < 150, (hostile.sent["api"], ran.peak_mb)
    assert ran.rc == 2, ran
    one_line(ran, hostile.endpoint, "more than 33,554,432 bytes")


def test_a_remote_config_json_that_never_ends_is_read_no_further_than_its_published_size(hostile):
    repo = honest()
    repo.files["config.json"] = Body.of(json.dumps(CONFIG).encode(), runs_on=300 * MB)
    hostile.fake("org/endless", repo)
    ran = run([ROLLOUT, "validate", "org/endless", "--endpoint", hostile.endpoint])
    assert hostile.sent["config.json"] < 20 * MB and ran.peak_mb < 120, (hostile.sent["config.json"], ran.peak_mb)
    assert ran.rc == 2, ran
    one_line(ran, "config.json", "published as")


def test_safetensors_headers_are_bounded_per_run_not_only_per_file(hostile):
    files = {"config.json": Body.of(json.dumps(CONFIG).encode())}
    files |= {f"model-0000{i}-of-00004.safetensors": claimed_header(100_000_000) for i in range(1, 5)}
    hostile.fake("org/headers", FakeRepo(files=files))
    ran = run([ROLLOUT, "validate", "org/headers", "--endpoint", hostile.endpoint])
    sent = sum(n for f, n in hostile.sent.items() if f.endswith(".safetensors"))
    assert sent < MB and ran.peak_mb < 120, (sent, ran.peak_mb)  # 8 bytes a shard: the length prefixes
    assert ran.rc == 2, ran
    one_line(ran, "400,000,000 bytes in all", "beyond")


# A one-module INT4 checkpoint that passes: the config's numbers are what the attacks change.
QUANT = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
             "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}


def write_checkpoint(folder: Path, config: dict, extra: dict | None = None, shape_values: int = 2) -> Path:
    """config.json and one safetensors file: down_proj packed (16 inputs at 4 bits), lm_head bf16."""
    folder.mkdir(parents=True)
    layer = "model.layers.0.mlp.down_proj"
    values = struct.pack("<2i", 4, 16) if shape_values == 2 else b""
    tensors = {f"{layer}.weight_shape": ("I32", [shape_values], values),
               f"{layer}.weight_packed": ("I32", [4, 2], bytes(32)),
               f"{layer}.weight_scale": ("BF16", [4, 1], bytes(8)),
               "lm_head.weight": ("BF16", [4, 4], bytes(32))} | (extra or {})
    header, placed, offset = {}, [], 0
    for name, (dtype, shape, raw) in tensors.items():
        size = {"I32": 4, "BF16": 2}[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        placed.append((offset, raw))
        offset += size
    raw_header = json.dumps(header).encode()
    with (folder / "model.safetensors").open("wb") as fh:
        fh.write(struct.pack("<Q", len(raw_header)) + raw_header)
        for at, raw in placed:  # only the bytes given: the rest stays zero, and a big tensor sparse
            fh.seek(8 + len(raw_header) + at)
            fh.write(raw)
        fh.truncate(8 + len(raw_header) + offset)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_the_tiny_checkpoint_passes_as_written(tmp_path):
    ran = run([ROLLOUT, "validate", str(write_checkpoint(tmp_path / "m", CONFIG | {"quantization_config": QUANT}))])
    assert ran.rc == 0 and ran.out.startswith("pass:"), ran


def _bits(n):
    q = json.loads(json.dumps(QUANT))
    q["config_groups"]["group_0"]["weights"]["num_bits"] = n
    return CONFIG | {"quantization_config": q}


@pytest.mark.parametrize("config, words", [
    (_bits(0), ["num_bits"]), (_bits(64), ["num_bits"]), (_bits(2**63), ["num_bits"]),
    ({**_bits(4), "text_config": [1, 2]}, ["text_config", "not an object"]),
    ({**_bits(4), "num_hidden_layers": "abc"}, ["num_hidden_layers"]),
    ({**_bits(4), "num_hidden_layers": 1.2e29}, ["num_hidden_layers"]),
    ({**_bits(4), "num_hidden_layers": 12 * 10**28}, ["num_hidden_layers"]),
    ({**_bits(4), "num_nextn_predict_layers": "x"}, ["num_nextn_predict_layers"]),
    ({**_bits(4), "n_routed_experts": -3}, ["n_routed_experts"]),
    ({**CONFIG, "quantization_config": QUANT | {"ignore": ["re:("]}}, ["'re:('", "not a valid regular expression"]),
    ({**CONFIG, "quantization_config": QUANT | {"ignore": ["re:[[:alpha:]]+"]}}, ["Possible nested set"]),
    ({**CONFIG, "quantization_config": [QUANT]}, ["quantization_config", "not an object"]),
], ids=["bits-0", "bits-64", "bits-2^63", "text-config-list", "layers-text", "layers-1.2e29-float",
        "layers-1.2e29-int", "nextn-text", "experts-negative", "unbalanced-regex", "nested-set", "quant-config-list"])
def test_malformed_config_values_are_one_line_naming_the_field_exit_2(tmp_path, config, words):
    ran = run([ROLLOUT, "validate", str(write_checkpoint(tmp_path / "m", config))])
    assert ran.rc == 2, ran
    one_line(ran, "config.json", *words)


LONG = "model.layers.0.mlp.shared_experts_kept_in_bf16_for_this_test.down_proj"  # 72 characters


@pytest.mark.parametrize("pattern", [r"re:(.|.)*!", r"re:(?:[\w.]+)+!"])
def test_a_pattern_that_backtracks_catastrophically_ends_in_seconds(tmp_path, pattern):
    """Python's re takes 2^n steps for these on an n-character name; the regex package defuses most
    such patterns, and the time budget refuses the rest in one line naming the pattern."""
    quant = QUANT | {"ignore": ["lm_head", LONG, pattern]}
    model = write_checkpoint(tmp_path / "m", CONFIG | {"quantization_config": quant},
                             extra={f"{LONG}.weight": ("BF16", [4, 4], bytes(32))})
    ran = run([ROLLOUT, "validate", str(model)], timeout=90, env={"ROLLOUT_PATTERN_SECONDS": "2"})
    assert ran.seconds < 45, ran.seconds  # the budget, and the command's start-up on a busy machine
    if ran.rc == 2:
        one_line(ran, repr(pattern), "backtracks")
    else:
        assert ran.rc == 0 and "Traceback" not in ran.err, ran  # defused: the checkpoint's own verdict


def test_names_from_the_checkpoint_cannot_forge_lines_of_the_report(tmp_path):
    model = write_checkpoint(tmp_path / "m", CONFIG | {"quantization_config": QUANT | {
        "ignore": ["lm_head", "nothing\npass: forged\x1b[2J"]}})
    ran = run([ROLLOUT, "validate", str(model)])
    assert ran.rc == 0, ran
    assert not [line for line in ran.out.splitlines() if line.startswith("pass: forged")]
    assert "\x1b" not in ran.out and "nothing\\x0apass: forged\\x1b[2J" in ran.out


def test_a_weight_shape_of_millions_of_values_is_not_read(tmp_path):
    model = write_checkpoint(tmp_path / "m", CONFIG | {"quantization_config": QUANT}, shape_values=50_000_000)
    ran = run([ROLLOUT, "validate", str(model)])
    assert ran.rc == 1 and "expected an integer tensor of 2 values" in ran.out, ran  # named, as a layout fault
    assert ran.peak_mb < 120, ran.peak_mb  # 200 MB of values on disk (sparse), none of them read


def test_a_scale_without_its_weight_is_no_crash(tmp_path):
    stray = {"model.layers.0.mlp.up_proj.weight_scale": ("BF16", [4, 1], bytes(8))}
    ran = run([ROLLOUT, "validate", str(write_checkpoint(tmp_path / "m", CONFIG | {"quantization_config": QUANT},
                                                         extra=stray))])
    assert ran.rc == 0 and "Traceback" not in ran.err, ran


def test_the_hf_token_goes_to_the_hub_and_never_to_the_mirror_or_a_redirect(hostile, tmp_path, monkeypatch):
    """Real requests to recording servers: the hub, a mirror that has nothing (so every file also
    comes from the hub), and the host a redirect points at."""
    from tasks.errors import HubError
    from tasks.hub import fetch_file, resolve_snapshot

    token, shared = "hf_hostile_test_token", "fleet-mirror-token"
    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setenv("ROLLOUT_MIRROR_TOKEN", shared)
    hostile.fake("org/tok", honest())
    with Recorder() as mirror, Recorder() as elsewhere:
        repo = hostile.fakes["org/tok"]
        repo.files["weights.bin"] = Body.of(b"weights")
        hostile.redirects["weights.bin"] = f"{elsewhere.endpoint}/signed/weights.bin"
        snap = resolve_snapshot("org/tok", "main", hostile.endpoint)
        cache = tmp_path / "models" / "hub"
        for f in snap.files:
            if f.path == "weights.bin":
                with pytest.raises(HubError):  # the redirect's target has no such file
                    fetch_file(snap, f, cache, endpoint=hostile.endpoint)
            else:
                assert fetch_file(snap, f, cache, endpoint=hostile.endpoint, mirror=mirror.endpoint).source == "hub"
    asked = [auth for path, auth in hostile.auth_seen if "/resolve/" in path or "/api/" in path]
    assert asked and all(auth == f"Bearer {token}" for auth in asked)
    assert len(mirror.seen) == 2 and all(auth == f"Bearer {shared}" for _, auth in mirror.seen), mirror.seen
    assert elsewhere.seen and all(auth is None for _, auth in elsewhere.seen), elsewhere.seen
    assert token not in repr(mirror.seen + elsewhere.seen)
    assert not list(cache.rglob("*.part"))

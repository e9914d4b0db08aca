"""Shared fixtures: one Prefect test server, tiny checkpoints and a local Hub per session."""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# The test server serves no UI, but links to it (artifacts, notifications) are built from this URL.
os.environ.setdefault("PREFECT_UI_URL", "http://127.0.0.1:4200")
# vLLM's one worker runs inside its engine process (the CPU build allows its uniproc executor only
# with this): a third Python process's imports cost ~6 s of each ~18 s start on two cores, and the
# suite starts vLLM some sixty times. test_server_real keeps vLLM's default layout, a worker apart.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# Every vLLM this session starts inherits the mark, so process checks see only this session's own.
os.environ["ROLLOUT_TEST_SESSION"] = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from flows.demo import build_demo_repos  # noqa: E402
from testkit.faulty_hub import FaultyHub  # noqa: E402
from testkit.webhook import WebhookReceiver  # noqa: E402


# The files that take longest, in that order (CI's --durations): pytest-xdist hands whole files to
# its two workers in collection order (the Makefile turns off its reordering by tests per file), two
# to each at first, and the parallel part ends when its last file does. Started late, the fleet test
# kept it 4 minutes longer (a fresh clone's .ci/run: 27.4 minutes in this order, 28.7 in xdist's).
LONGEST_FIRST = ("test_fleet.py", "test_operator.py", "test_answers_rollout.py", "test_tune.py",
                 "test_swap_signal.py", "test_kimi.py", "test_cancel.py", "test_ui.py", "test_lock_restart.py",
                 "test_server_real.py", "test_prefect_lost.py", "test_e2e.py", "test_group.py", "test_hostile.py",
                 "test_nightly_schedule.py", "test_prepare.py", "test_server.py")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ROLLOUT_TEST_TIMELINE set, one JSON line per test (worker, test, start, end) appended to
    that file: which worker ran what when, to see where a parallel part's minutes go."""
    started = time.time()
    yield
    if timeline := os.environ.get("ROLLOUT_TEST_TIMELINE"):
        with open(timeline, "a") as out:
            out.write(json.dumps({"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "test": item.nodeid,
                                  "start": started, "end": time.time()}) + "\n")


def pytest_collection_modifyitems(items):
    """The ten-repeat interval test first, before the Prefect server, the local Hub or any vLLM
    starts: its repeats compare the fixed-speed server's pace over a minute, and a machine busy
    beside it moves that pace between repeats by more than any interval taken within one. Then the
    longest files; the order within a file is kept."""
    def order(item) -> tuple[bool, int]:
        name = item.path.name
        return (item.get_closest_marker("repeatability") is None,
                LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST))
    items.sort(key=order)


@pytest.fixture(scope="session")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(scope="session")
def hub_root(tmp_path_factory) -> Path:
    """The tiny MoE's two repos, copied for this session from a build that `make test`'s three
    sessions (the quiet part and the two workers) share: training takes ~45 s, ~80 s with two at once."""
    root = tmp_path_factory.mktemp("hub")
    shutil.copytree(_demo_repos_built_once(kimi=False), root, dirs_exist_ok=True)
    return root


@pytest.fixture(scope="session")
def kimi_repos(hub_root, local_hub) -> tuple[str, str]:
    """The tiny Kimi-K2.5's two repos added to the session's Hub: built by the first session that
    asks (~80 s of training), in the parallel part, not before the quiet part's tests as all four were."""
    from flows.demo import KIMI_INT4_REPO, KIMI_REPO

    built = _demo_repos_built_once(kimi=True)
    for repo in (KIMI_REPO, KIMI_INT4_REPO):
        shutil.copytree(built / repo, hub_root / repo, dirs_exist_ok=True)
    local_hub.refresh()
    return KIMI_REPO, KIMI_INT4_REPO


def _demo_repos_built_once(*, kimi: bool) -> Path:
    """Built by the first session that asks, under a lock the others wait on; keyed by the code that
    builds them, so a change to the recipe builds afresh. The Kimi build starts from the other's."""
    import fcntl
    import hashlib
    import tempfile

    import flows.demo
    import flows.demo.checkpoint
    import flows.demo.kimi
    import flows.demo.kimi_model

    modules = (flows.demo, flows.demo.checkpoint) + ((flows.demo.kimi, flows.demo.kimi_model) if kimi else ())
    files = sorted(flows.demo.kimi.FILES.iterdir()) if kimi else []
    recipe = b"".join(p.read_bytes() for p in [*(Path(m.__file__) for m in modules), *files] if p.is_file())
    kind = "kimi" if kimi else "moe"
    built = Path(tempfile.gettempdir()) / f"rollout-demo-repos-{kind}-{hashlib.sha256(recipe).hexdigest()[:12]}"
    base = _demo_repos_built_once(kimi=False) if kimi else None
    with open(f"{built}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not built.exists():
            building = Path(tempfile.mkdtemp(prefix=f"{built.name}-building-", dir=built.parent))
            if base is not None:
                shutil.copytree(base, building, dirs_exist_ok=True)
            build_demo_repos(building, kimi=kimi)
            building.rename(built)
    return built


@pytest.fixture(scope="session")
def local_hub(hub_root):
    with FaultyHub(hub_root) as hub:
        yield hub


SHARDED_REPO = "org/sharded"
SHARD = 2 * 2**20
BIG = "model-big.safetensors"
BIG_SIZE = 24 * 2**20


@pytest.fixture(scope="session")
def fetch_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fetch-hub")
    repo = root / SHARDED_REPO
    repo.mkdir(parents=True)
    (repo / "config.json").write_text(json.dumps({"model_type": "test"}))
    for i in range(3):
        (repo / f"model-0000{i + 1}-of-00003.safetensors").write_bytes(os.urandom(SHARD))
    (repo / BIG).write_bytes(os.urandom(BIG_SIZE))
    return root


@pytest.fixture
def hub(fetch_root):
    with FaultyHub(fetch_root) as hub:
        yield hub


@pytest.fixture
def webhook():
    """A local endpoint that records what Prefect's notifications post to it."""
    with WebhookReceiver() as hook:
        yield hook


def vllm_processes(wait_s: float = 5.0) -> list[int]:
    """Live vLLM processes (API server, VLLM::EngineCore, VLLM::Worker_*) started by this test
    session, once those still exiting have had `wait_s` to go: with the suite two at a time, a
    stopped group's last process was once still exiting when a test looked (a leak stays)."""
    import time

    deadline = time.monotonic() + wait_s
    while (found := _vllm_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


def _vllm_processes() -> list[int]:
    mark = f"ROLLOUT_TEST_SESSION={os.environ['ROLLOUT_TEST_SESSION']}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().lower()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if b"vllm" in cmd and state != "Z" and mark in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def artifact(key: str):
    """The newest artifact under key: the session's flows publish some keys more than once."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
                                      sort=ArtifactSort.CREATED_DESC, limit=1)
    assert found, f"no artifact {key}"
    return found[0]


def demo_answer(port: int) -> str | None:
    """The demo model's greedy answer to "41 42 43" on a host's port (" 44 45 46" when it serves
    right); None where nothing answers."""
    import httpx

    from flows.demo import BF16_REPO

    try:
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30, json={
            "model": BF16_REPO, "prompt": "41 42 43", "max_tokens": 3, "temperature": 0}).json()
    except httpx.HTTPError:
        return None
    return reply["choices"][0]["text"]

"""The prestart's gate (tasks/vllm/gate.py) with a stand-in for vLLM's API server module: it is imported
ahead, runs only once the gate opens, with its arguments, and never runs when the gate is cancelled
or the process that launched it dies. The deploy's swap through it, with the real vLLM, is in
tests/test_answers_rollout.py (the gap a client sees) and tests/test_operator.py (faults mid-swap)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tasks.errors import ServerStartError
from tasks.vllm.process import Prestarted, _cpus_while_held, _launch, cancel_prestart, open_gate, wait_imported
from tasks.vllm.settings import ServerConfig

SERVER = textwrap.dedent('''
    import os, sys, time
    from pathlib import Path
    Path("{marks}/imported").write_text(str(time.monotonic()))
    Path("{marks}/imported-on").write_text(str(sorted(os.sched_getaffinity(0))))
    if __name__ == "__main__":
        Path("{marks}/ran-on").write_text(str(sorted(os.sched_getaffinity(0))))
        Path("{marks}/ran").write_text(" ".join(sys.argv[1:]))
''')


@pytest.fixture()
def stand_in(tmp_path, monkeypatch):
    """A module `stand_in_server` that marks when it is imported and when it runs as __main__."""
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "stand_in_server.py").write_text(SERVER.format(marks=marks))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    return marks


def launch(gate: Path, *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tasks.vllm.gate", str(gate), "-m", "stand_in_server", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def wait_for(path: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_imported_ahead_and_run_with_its_arguments_once_the_gate_opens(tmp_path, stand_in):
    gate = tmp_path / "gate"
    proc = launch(gate, "--port", "8123")
    wait_for(stand_in / "imported")
    time.sleep(0.5)
    assert proc.poll() is None and not (stand_in / "ran").exists()  # held at the gate
    gate.write_text("open")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert (stand_in / "ran").read_text() == "--port 8123"
    assert "stand_in_server imported; waiting at" in out


def test_a_cancelled_gate_never_runs_the_server(tmp_path, stand_in):
    gate = tmp_path / "gate"
    proc = launch(gate)
    wait_for(stand_in / "imported")
    gate.write_text("cancel")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "says 'cancel'; not starting" in out
    assert not (stand_in / "ran").exists()


def test_the_launchers_death_ends_it_before_the_server_runs(tmp_path, stand_in):
    """A deploy killed (kill -9) while its old server still answered: the held vLLM must not start
    behind its back once its gate is written by nobody, nor wait forever holding its memory."""
    gate, pid_file = tmp_path / "gate", tmp_path / "gate.pid"
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f'''
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-m", "tasks.vllm.gate", {str(gate)!r}, "-m", "stand_in_server"])
        open({str(pid_file)!r}, "w").write(str(p.pid))
        time.sleep(600)
    ''')])
    wait_for(stand_in / "imported")
    held = int(pid_file.read_text())
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{held}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{held}").exists() or "Z" in Path(f"/proc/{held}/stat").read_text().rsplit(")", 1)[1][:3]
    gate.write_text("open")  # too late: nothing is left to start
    time.sleep(0.3)
    assert not (stand_in / "ran").exists()


def _prestarted(tmp_path: Path, proc: subprocess.Popen, log_path: Path) -> Prestarted:
    return Prestarted(cfg=None, run_dir=tmp_path, port=None, command=[], process=proc, gate=tmp_path / "gate",
                      log_path=log_path)


def test_the_deploy_waits_for_the_imports_and_a_failed_import_is_a_classified_failed_start(tmp_path, stand_in):
    # Imported: the gate's line is found however the log's writes fall.
    log_path = tmp_path / "vllm.next.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tasks.vllm.gate", str(tmp_path / "gate"), "-m",
                                 "stand_in_server"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    pre = _prestarted(tmp_path, proc, log_path)
    waited = wait_imported(pre, timeout_s=60, poll_s=0.01)
    assert waited < 60 and (stand_in / "imported").exists() and proc.poll() is None
    cancel_prestart(pre)
    assert proc.poll() is not None and not (stand_in / "ran").exists()

    # A vLLM that cannot be imported (a build for another GPU): the swap stops with the old server
    # still serving, and the error is read from the log like any failed start's.
    (stand_in.parent / "broken_server.py").write_text(
        'raise RuntimeError("CUDA error: no kernel image is available for execution on the device")\n')
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tasks.vllm.gate", str(tmp_path / "gate"), "-m",
                                 "broken_server"], stdout=log, stderr=subprocess.STDOUT)
    with pytest.raises(ServerStartError) as failed:
        wait_imported(_prestarted(tmp_path, proc, log_path), timeout_s=60)
    assert failed.value.cause == "cuda-kernel-error" and "no kernel image" in str(failed.value)
    assert str(failed.value).startswith("vLLM exited with code 1 while it was imported ahead of the swap")
    assert failed.value.log_tail.strip().endswith("no kernel image is available for execution on the device")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a CPU besides the server's")
def test_it_imports_off_the_old_servers_cpus_and_runs_on_its_own(tmp_path, stand_in):
    # The old server answers on the server's CPUs until the stop: the held imports run on the rest,
    # and the server moves onto its CPUs when its gate opens.
    server_cpu = min(os.sched_getaffinity(0))
    cfg = ServerConfig(model_path=tmp_path, served_model_name="m", cpus=str(server_cpu))
    log_path, gate = tmp_path / "vllm.next.log", tmp_path / "vllm.gate"
    proc = _launch([sys.executable, "-m", "tasks.vllm.gate", str(gate), "-m", "stand_in_server"], cfg, log_path,
                   None, cpus=_cpus_while_held(cfg))
    pre = Prestarted(cfg=cfg, run_dir=tmp_path, port=None, command=["vllm"], process=proc, gate=gate,
                     log_path=log_path)
    wait_imported(pre, timeout_s=60, poll_s=0.01)
    held_on = json.loads((stand_in / "imported-on").read_text())
    assert held_on and server_cpu not in held_on
    open_gate(pre)
    wait_for(stand_in / "ran")
    assert json.loads((stand_in / "ran-on").read_text()) == [server_cpu]
    proc.wait(timeout=30)

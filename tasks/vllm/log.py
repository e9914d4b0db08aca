"""What vLLM's log says: why a start failed, how far loading has come, what the engine reported."""

from __future__ import annotations

import re
from pathlib import Path

LOG_TAIL_LINES = 60

# First matching pattern names the cause of a failed start; order matters (specific first).
FAILURE_CAUSES = [
    ("port-in-use", r"Address already in use"),
    ("invalid-argument", r"unrecognized arguments|error: argument|invalid choice"),
    ("out-of-memory", r"CUDA out of memory|OutOfMemoryError|Not enough memory|insufficient memory"),
    ("kv-cache-too-small", r"larger than the maximum number of tokens that can be stored in KV cache|No available memory for the cache blocks"),
    ("nccl", r"NCCL error|ncclInternalError|NCCL WARN"),
    ("max-model-len-too-long", r"max_model_len \(\d+\) is greater than the derived"),
    ("unsupported-model", r"not supported|Unsupported|No .* backend supports|ValidationError|does not recognize this architecture|Invalid repository ID|JSONDecodeError|Error loading config|config\.json"),
]


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


def classify_failure(log: str) -> tuple[str, str]:
    """(cause id, the log line that shows it)."""
    for cause, pattern in FAILURE_CAUSES:
        for line in reversed(log.splitlines()):
            if re.search(pattern, line):
                return cause, line.strip()
    errors = [ln.strip() for ln in log.splitlines() if re.search(r"Error|error", ln)]
    return "exited", (errors[-1] if errors else "no error line in the log")


# Start-up milestones worth a line in the Prefect log while a 1T model loads for 5-15 minutes.
PROGRESS = re.compile(r"Loading weights took|Model loading took|KV cache size|Maximum concurrency|init engine|"
                      r"Graph capturing finished|Starting vLLM server")
FACTS = {
    "kv_cache_tokens": r"KV cache size: ([\d,]+) tokens",
    "kv_cache_requests": r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+x)",
    "weights_load_s": r"Loading weights took ([\d.]+) s",
    "model_load_s": r"Model loading took [\d.]+ GiB (?:memory )?and ([\d.]+) s",
    "engine_init_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) s",
}


def server_facts(log: str) -> dict[str, str]:
    """What vLLM reported about itself at start-up, by the phrases it logs (absent ones left out)."""
    return {key: m[1] for key, pattern in FACTS.items() if (m := re.search(pattern, log))}

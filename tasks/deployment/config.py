"""The run form: what to deploy and how to benchmark it.

The Prefect UI renders it from the redeploy deployment, the nightly fills it in, and `rollout
deploy` generates its options from it; it imports only the settings models, so the CLI starts fast.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from tasks.answers.spec import AnswerSpec
from tasks.bench.spec import BenchSpec
from tasks.vllm.settings import VllmSettings


class DeployConfig(BaseModel):
    """What to deploy and how to benchmark it; the Prefect UI renders this as the run form."""

    repo_id: str = Field(..., description="Hugging Face model repo, e.g. moonshotai/Kimi-K2.5")
    revision: str = Field("main", description="Branch, tag or commit; resolved to a commit sha before download")
    models_root: Path = Field(Path("/models"), description="Filesystem that holds the HF cache (models_root/hub)")
    hub_endpoint: str | None = Field(None, description="Hub URL; empty uses HF_ENDPOINT or huggingface.co")
    mirror_endpoint: str | None = Field(None, description="A Hub mirror on the local network (another host's "
                                        "`rollout mirror`) to read files from first; each is held to the Hub's "
                                        "sha256, and one that fails comes from the Hub")
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
    answers: AnswerSpec = Field(default_factory=AnswerSpec, description="The answer check before the benchmark")
    bench: BenchSpec = Field(default_factory=BenchSpec, description="Benchmark load and sweep")
    keep_serving: bool = Field(True, description="Leave the new server serving after its benchmark (the "
                               "deployment); off stops it, and a server it replaced stays stopped")
    max_regression: float | None = Field(0.1, ge=0, lt=1,
                                         description="Fail and roll back when single-stream or peak tok/s falls "
                                         "(or p99 TTFT grows) by more than this fraction against the last good "
                                         "deployment of the same model on this host; empty: no check")
    use_tuned: bool = Field(True, description="Serve with the vLLM settings `rollout tune --promote` chose for "
                                              "this model on this host, where it did, instead of the ones above")

    @property
    def cache_dir(self) -> Path:
        return self.models_root / "hub"

    @property
    def run_dir(self) -> Path:
        """Server state file and log, one per host: there is one server per models root."""
        return self.models_root / ".rollout"

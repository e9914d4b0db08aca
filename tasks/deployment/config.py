"""The run form: what to deploy and how to benchmark it.

The Prefect UI renders it from the redeploy deployment, the nightly fills it in, and `rollout
deploy` generates its options from it; it imports only the settings models, so the CLI starts fast.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, model_validator

from tasks.answers.spec import AnswerSpec
from tasks.bench.spec import BenchSpec
from tasks.trust import loopback
from tasks.vllm.settings import VllmSettings


class Follower(BaseModel):
    """A secondary node of a model larger than one box, deployed through its own host's worker."""

    host: str = Field(..., pattern=r"^[a-z0-9][a-z0-9-]*$",
                      description="The host's name: its `join-group/<host>` deployment starts vLLM headless there")
    models_root: Path = Field(Path("/models"), description="That host's filesystem for the HF cache")


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
    prewarm: bool = Field(True, description="Read the new model's shards into the page cache before the old "
                          "server stops (within MemAvailable less prewarm_margin_gb and the serving model's files), so "
                          "vLLM's load after the stop reads memory, not disk")
    prewarm_margin_gb: float = Field(8.0, ge=0, description="Memory left to the host when prewarming, in GB")
    prestart: bool = Field(True, description="Launch the new vLLM before the old server stops, its Python imports "
                           "done (off the server's CPUs) and held at a gate until the stop (tasks/vllm/gate.py), so "
                           "the host serves nothing only for the rest of the start (benchmarks/swap.py: 9-10 s less "
                           "here)")
    keep_serving: bool = Field(True, description="Leave the new server serving after its benchmark (the "
                               "deployment); off stops it, and a server it replaced stays stopped")
    max_regression: float | None = Field(0.1, ge=0, lt=1,
                                         description="Fail and roll back when single-stream or peak tok/s falls "
                                         "(or p99 TTFT grows) by more than this fraction against the last good "
                                         "deployment of the same model on this host; empty: no check")
    followers: list[Follower] = Field(default_factory=list,
                                      description="Secondary nodes, in node order, for a model larger than one box: "
                                      "with nnodes (one TP/PP group over the nodes) or data_parallel_size_local "
                                      "(data-parallel ranks over the nodes); this host leads and serves the API")
    take_over: bool = Field(False, description="Where this host's records (server.json, last-good.json) are "
                            "damaged: set them aside and stop every vLLM on the host, instead of refusing")
    use_tuned: bool = Field(True, description="Serve with the vLLM settings `rollout tune --promote` chose for "
                                              "this model on this host, where it did, instead of the ones above")

    @model_validator(mode="after")
    def _load_fits(self) -> DeployConfig:
        """A benchmark request longer than the server's context is refused by vLLM, every one of them:
        say so before a 595 GB download, not after it."""
        limit, load = self.vllm.max_model_len, self.bench.input_len + self.bench.output_len
        if limit is not None and load > limit:
            raise ValueError(f"bench.input_len {self.bench.input_len} + bench.output_len {self.bench.output_len} = "
                             f"{load} tokens per request, beyond vllm.max_model_len {limit}: every request would "
                             "be refused")
        return self

    @model_validator(mode="after")
    def _group_adds_up(self) -> DeployConfig:
        """A group whose nodes do not add up would hang at start-up waiting for a rank; say so first."""
        if not self.followers:
            return self
        nodes, v = len(self.followers) + 1, self.vllm
        if v.nnodes > 1:
            if v.nnodes != nodes:
                raise ValueError(f"followers: {nodes} nodes, but vllm.nnodes is {v.nnodes}")
            if not v.master_addr:
                raise ValueError("followers: vllm.master_addr (this host's address, rank 0) is empty")
        elif v.data_parallel_size_local:
            if v.data_parallel_size != v.data_parallel_size_local * nodes:
                raise ValueError(f"followers: {nodes} nodes of {v.data_parallel_size_local} data-parallel ranks "
                                 f"each, but vllm.data_parallel_size is {v.data_parallel_size}")
            if not v.data_parallel_address:
                raise ValueError("followers: vllm.data_parallel_address (this host's address) is empty")
        else:
            raise ValueError("followers: set vllm.nnodes (TP/PP over the nodes) or vllm.data_parallel_size_local "
                             "(data-parallel ranks over the nodes)")
        return self

    def group_members(self) -> list[tuple[str, DeployConfig]]:
        """Each secondary node's host and deploy: this model on that host's models root, as its rank."""
        v = self.vllm
        return [(f.host, self.model_copy(update={
            "models_root": f.models_root, "followers": [], "mirror_endpoint": self.mirror_endpoint,
            "vllm": v.model_copy(update={"node_rank": i} if v.nnodes > 1 else
                                 {"data_parallel_start_rank": i * (v.data_parallel_size_local or 1)})}))
            for i, f in enumerate(self.followers, start=1)]

    def exposure_warning(self) -> str | None:
        """One line for the deploy's log when vLLM will listen beyond loopback with no API key:
        anyone who reaches the address can use the model. None where it is loopback or keyed."""
        if self.api_key_secret or loopback(self.host):
            return None
        return (f"vLLM listens on {self.host}:{self.port} with no API key: anyone who reaches that address can use "
                "the model; set api_key_secret to a Prefect Secret block holding one (docs/security.md)")

    @property
    def cache_dir(self) -> Path:
        return self.models_root / "hub"

    @property
    def run_dir(self) -> Path:
        """Server state file and log, one per host: there is one server per models root."""
        return self.models_root / ".rollout"

"""The engine settings an operator chooses, and one launch of them."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from tasks.cpus import CpuList


class VllmSettings(BaseModel):
    """The engine settings an operator chooses (the UI shows them as one group); anything vLLM
    has beyond these goes through extra_args verbatim. Each field is the vLLM flag of its name
    (engine_flags); its default is vLLM's, and None or the default leaves the flag out."""

    tensor_parallel_size: int = Field(1, ge=1, description="--tensor-parallel-size (8 on an 8-GPU box)")
    pipeline_parallel_size: int = Field(1, ge=1, description="--pipeline-parallel-size")
    data_parallel_size: int = Field(1, ge=1, description="--data-parallel-size")
    enable_expert_parallel: bool = Field(False, description="--enable-expert-parallel for MoE models")
    all2all_backend: str | None = Field(None, description="--all2all-backend (was VLLM_ALL2ALL_BACKEND)")
    # Across hosts: vLLM launches its own ranks on each node; these flags tell each node its place.
    distributed_executor_backend: str | None = Field(None, description="--distributed-executor-backend: mp, or "
                                                     "ray for a Ray cluster spanning the nodes")
    nnodes: int = Field(1, ge=1, description="--nnodes one tensor/pipeline-parallel group spans (mp backend)")
    node_rank: int = Field(0, ge=0, description="--node-rank of this host among --nnodes")
    master_addr: str | None = Field(None, description="--master-addr: the rank-0 node, with --nnodes > 1")
    master_port: int | None = Field(None, ge=1, le=65535, description="--master-port on the rank-0 node (vLLM: 29501)")
    data_parallel_size_local: int | None = Field(None, ge=1, description="--data-parallel-size-local on this node")
    data_parallel_start_rank: int | None = Field(None, ge=0, description="--data-parallel-start-rank of this node")
    data_parallel_address: str | None = Field(None, description="--data-parallel-address: the head node")
    data_parallel_rpc_port: int | None = Field(None, ge=1, le=65535, description="--data-parallel-rpc-port")
    max_model_len: int | None = Field(None, ge=16, description="--max-model-len; empty keeps the model's")
    max_num_seqs: int | None = Field(None, ge=1, description="--max-num-seqs")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="--max-num-batched-tokens")
    kv_cache_dtype: str = Field("auto", description="--kv-cache-dtype; fp8 on SM120 (RTX PRO 6000) needs a "
                                                  "vLLM with FP8 in Triton MLA (PR #34597)")
    kv_cache_memory_bytes: int | None = Field(None, ge=1, description="--kv-cache-memory-bytes: the KV cache's "
                                              "size, instead of what gpu_memory_utilization leaves")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="--gpu-memory-utilization (0.9)")
    enforce_eager: bool = Field(False, description="--enforce-eager: no torch.compile nor CUDA graphs; starts "
                                "in seconds instead of a minute's compile, decodes slower")
    trust_remote_code: bool = Field(False, description="--trust-remote-code: your consent to run the Python a repo "
                                    "ships (its auto_map: Kimi's tokenizer), given once per repo and recorded on "
                                    "the host; without it such a repo is refused before any download")
    # How the weights come off the disk: on a cold page cache most of a 595 GB start is this.
    load_format: str | None = Field(None, description="--load-format: auto (vLLM's), safetensors, runai_streamer, "
                                    "fastsafetensors, ...")
    safetensors_load_strategy: str | None = Field(None, description="--safetensors-load-strategy: lazy (mmap), "
                                                  "eager (each file read whole), prefetch (every shard read into "
                                                  "the page cache first, in threads)")
    # Chat as the model's users use it; the answer check then asks a probe through each parser.
    enable_auto_tool_choice: bool = Field(False, description="--enable-auto-tool-choice: the model may call tools "
                                          "(with tool_call_parser)")
    tool_call_parser: str | None = Field(None, description="--tool-call-parser (kimi_k2 for Kimi-K2.5)")
    reasoning_parser: str | None = Field(None, description="--reasoning-parser (kimi_k2 for Kimi-K2.5)")
    extra_args: list[str] = Field(default_factory=list, description="Further vLLM flags, passed verbatim")
    env: dict[str, str] = Field(default_factory=dict, description="Environment for the vLLM process")
    cpus: CpuList | None = Field(None, description="CPUs the vLLM processes may use, as taskset lists them ('0', "
                                 "'0-13'); on a CPU host, leave the benchmark client a core of its own. Empty: any")


class ServerConfig(VllmSettings):
    """One launch: the settings plus what the flow decides (model path, name, address)."""

    model_path: Path
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535, description="0 picks a free port")
    headless: bool = False  # a secondary node of a multi-node group: engine ranks only, no API server

    @property
    def world_size(self) -> int:
        """Ranks one engine spans (tensor x pipeline parallel): over --nnodes hosts when > 1."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

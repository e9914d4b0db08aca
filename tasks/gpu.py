"""What accelerators this host has, from NVML.

The NVML module is a parameter so tests (and a CPU-only laptop) can describe any box, e.g. the
8x RTX PRO 6000 Blackwell (SM120, 96 GB, PCIe) the production deployment runs on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

from tasks.findings import Violation


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    memory_total_bytes: int
    memory_free_bytes: int
    compute_capability: tuple[int, int]


@dataclass(frozen=True)
class GpuProbe:
    platform: Literal["cuda", "cpu"]
    gpus: tuple[GpuInfo, ...] = ()
    driver: str | None = None
    reason: str | None = None  # why the probe found no GPU
    interconnect: Literal["nvlink", "pcie", "single"] = "single"  # "pcie" when any GPU pair lacks NVLink


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def probe(nvml: ModuleType | None = None) -> GpuProbe:
    """NVIDIA GPUs via NVML; a host without driver or devices is reported as "cpu", not an error."""
    if nvml is None:
        import pynvml as nvml
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ... all mean "no GPU here"
        return GpuProbe(platform="cpu", reason=f"NVML unavailable: {exc}")
    try:
        count = nvml.nvmlDeviceGetCount()
        gpus = []
        for i in range(count):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            gpus.append(
                GpuInfo(
                    index=i,
                    name=_text(nvml.nvmlDeviceGetName(h)),
                    memory_total_bytes=int(mem.total),
                    memory_free_bytes=int(mem.free),
                    compute_capability=tuple(nvml.nvmlDeviceGetCudaComputeCapability(h)),
                )
            )
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        interconnect = _interconnect(nvml, [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)])
    finally:
        nvml.nvmlShutdown()
    if not gpus:
        return GpuProbe(platform="cpu", driver=driver, reason="NVML found no devices")
    return GpuProbe(platform="cuda", gpus=tuple(gpus), driver=driver, interconnect=interconnect)


def _interconnect(nvml: ModuleType, handles: list) -> Literal["nvlink", "pcie", "single"]:
    """NVLink only if every pair can do P2P over it; allreduce runs at the slowest pair's speed."""
    if len(handles) < 2:
        return "single"
    for i, a in enumerate(handles):
        for b in handles[i + 1:]:
            try:
                status = nvml.nvmlDeviceGetP2PStatus(a, b, nvml.NVML_P2P_CAPS_INDEX_NVLINK)
            except Exception:  # older drivers lack the query: assume the slower path
                return "pcie"
            if status != nvml.NVML_P2P_STATUS_OK:
                return "pcie"
    return "nvlink"


@contextmanager
def energy_meter(count: int, nvml: ModuleType | None = None) -> Iterator[Callable[[], float] | None]:
    """A reader of the joules the first `count` GPUs have used since their driver loaded (NVML's
    total-energy counter, Volta and newer), or None where there is no NVML or no such counter:
    the benchmark then reports no energy rather than a wrong one."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            yield None
            return
    try:
        nvml.nvmlInit()
    except Exception:  # no driver, no devices: no energy to read
        yield None
        return
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(min(count, nvml.nvmlDeviceGetCount()))]

        def joules() -> float:
            return sum(nvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in handles) / 1000.0  # mJ

        try:
            joules()
        except Exception:  # NVMLError_NotSupported on GPUs without the counter
            yield None
            return
        yield joules if handles else None
    finally:
        nvml.nvmlShutdown()


@dataclass(frozen=True)
class HardwarePlan:
    """What the deployment will ask of the GPUs: a layout (TP x DP, EP on or off) and the
    checkpoint's bytes, routed experts apart, since a layout places them differently."""

    tensor_parallel_size: int
    weights_bytes: int
    kv_cache_fp8: bool  # from the checkpoint's kv_cache_scheme or --kv-cache-dtype fp8*
    gpu_memory_utilization: float = 0.9
    kv_cache_reserve_bytes: int = 4 * 10**9
    data_parallel_size: int = 1
    expert_parallel: bool = False
    routed_expert_bytes: int = 0  # of weights_bytes; the validation summary's "routed expert" rows
    fp8_kv_on_sm12x: bool | None = None  # whether the installed vLLM's MLA backend there takes FP8 KV
    nodes: int = 1  # hosts the layout spans (a multi-node group); each holds an equal share of the ranks

    @property
    def ranks(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def gpus_needed(self) -> int:
        """This host's share of the ranks."""
        return -(-self.ranks // self.nodes)

    @property
    def weights_per_gpu(self) -> float:
        """Routed experts are divided over every EP rank (TP x DP) with EP, else over TP; everything
        else is divided over TP and copied on every DP rank."""
        others = self.weights_bytes - self.routed_expert_bytes
        expert_ranks = self.ranks if self.expert_parallel else self.tensor_parallel_size
        return others / self.tensor_parallel_size + self.routed_expert_bytes / expert_ranks

    @property
    def layout(self) -> str:
        dp = f" x DP={self.data_parallel_size}" if self.data_parallel_size > 1 else ""
        nodes = f" over {self.nodes} nodes" if self.nodes > 1 else ""
        return f"TP={self.tensor_parallel_size}{dp}{' + EP' if self.expert_parallel else ''}{nodes}"


def check_hardware(gpu: GpuProbe, plan: HardwarePlan) -> list[Violation]:
    """Blocking problems as violations (rule ids stable); the PCIe warning has rule pcie-tensor-parallel."""
    if gpu.platform != "cuda":
        return []
    found = []
    if plan.gpus_needed > len(gpu.gpus):
        found.append(Violation(rule="tp-exceeds-gpus", module="tensor_parallel_size",
                               message=f"{plan.layout} needs {plan.gpus_needed} GPUs per host but this host has "
                                       f"{len(gpu.gpus)}"))
    sm12 = [g for g in gpu.gpus if g.compute_capability[0] == 12]
    if plan.kv_cache_fp8 and sm12 and not plan.fp8_kv_on_sm12x:
        found.append(Violation(
            rule="fp8-kv-cache-on-sm12x", module="kv_cache",
            message=f"FP8 KV cache on compute capability 12.x ({sm12[0].name}) fails in this vLLM's MLA "
                    "backend there (Triton MLA takes FP8 KV from vLLM PR #34597 on); serve with "
                    "--kv-cache-dtype auto (bf16 KV) or a newer vLLM"))
    per_gpu = plan.weights_per_gpu
    for g in gpu.gpus[: plan.gpus_needed]:
        budget = g.memory_total_bytes * plan.gpu_memory_utilization
        if per_gpu + plan.kv_cache_reserve_bytes > budget:
            found.append(Violation(
                rule="weights-exceed-gpu-memory", module=f"gpu{g.index}",
                message=f"{per_gpu / 1e9:.1f} GB of weights per GPU at {plan.layout} + "
                        f"{plan.kv_cache_reserve_bytes / 1e9:.1f} GB KV reserve > {budget / 1e9:.1f} GB "
                        f"({plan.gpu_memory_utilization:.0%} of {g.memory_total_bytes / 1e9:.0f} GB)"))
            break
    return found


def hardware_warnings(gpu: GpuProbe, plan: HardwarePlan) -> list[Violation]:
    found = []
    if gpu.platform == "cuda" and gpu.interconnect == "pcie" and plan.tensor_parallel_size > 2:
        found.append(Violation(rule="pcie-tensor-parallel", module="interconnect",
                               message=f"TP={plan.tensor_parallel_size} over PCIe only: every layer's allreduce "
                                       "crosses PCIe; expect single-stream decode well below an NVLink box"))
    if (gpu.platform == "cuda" and plan.kv_cache_fp8 and plan.fp8_kv_on_sm12x
            and any(g.compute_capability[0] == 12 for g in gpu.gpus)):
        found.append(Violation(rule="fp8-kv-cache-on-sm12x", module="kv_cache",
                               message="FP8 KV cache on compute capability 12.x: this vLLM's Triton MLA backend "
                                       "takes it (vLLM PR #34597); check the answer check's accuracy"))
    return found


def kv_cache_is_fp8(kv_cache_scheme: dict | None, kv_cache_dtype: str) -> bool:
    if kv_cache_dtype.startswith("fp8"):
        return True
    return bool(kv_cache_scheme) and kv_cache_scheme.get("type") == "float" and kv_cache_scheme.get("num_bits") == 8

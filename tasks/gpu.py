"""What accelerators this host has, from NVML.

The NVML module is a parameter so tests (and a CPU-only laptop) can describe any box, e.g. the
8x RTX PRO 6000 Blackwell (SM120, 96 GB, PCIe) the production deployment runs on.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Literal

from prefect import task


class GpuConfigError(RuntimeError):
    """The requested parallelism cannot run on this host."""


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
    finally:
        nvml.nvmlShutdown()
    if not gpus:
        return GpuProbe(platform="cpu", driver=driver, reason="NVML found no devices")
    return GpuProbe(platform="cuda", gpus=tuple(gpus), driver=driver)


def check_parallelism(gpu: GpuProbe, tensor_parallel_size: int) -> GpuProbe:
    """Fail before launch when TP cannot be placed; on CPU, vLLM's own CPU backend runs it."""
    if gpu.platform == "cuda" and tensor_parallel_size > len(gpu.gpus):
        raise GpuConfigError(
            f"tensor_parallel_size={tensor_parallel_size} but this host has {len(gpu.gpus)} GPU(s)"
        )
    return gpu


@task(name="probe-gpus", tags=["gpu"])
def probe_gpus(tensor_parallel_size: int) -> GpuProbe:
    return check_parallelism(probe(), tensor_parallel_size)

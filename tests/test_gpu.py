"""The probe against a described NVML: 8x RTX PRO 6000 Blackwell (SM120, 96 GB), or none at all."""

from types import SimpleNamespace

import pytest

from tasks.gpu import GpuConfigError, check_parallelism, probe

GB = 10**9


class FakeNvml:
    def __init__(self, count=8, name="NVIDIA RTX PRO 6000 Blackwell Server Edition", cc=(12, 0), total=96 * GB,
                 fail_init=None):
        self.count, self.name, self.cc, self.total, self.fail_init = count, name, cc, total, fail_init
        self.shutdowns = 0

    def nvmlInit(self):
        if self.fail_init:
            raise self.fail_init

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self.name.encode()  # older bindings return bytes

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=self.total, free=self.total - GB * (h + 1), used=GB * (h + 1))

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return self.cc

    def nvmlSystemGetDriverVersion(self):
        return "580.95.05"


def test_probe_describes_eight_sm120_gpus():
    nvml = FakeNvml()
    result = probe(nvml)
    assert result.platform == "cuda"
    assert len(result.gpus) == 8
    assert {g.compute_capability for g in result.gpus} == {(12, 0)}
    assert result.gpus[0].name.startswith("NVIDIA RTX PRO 6000")
    assert result.gpus[3].memory_free_bytes == 92 * GB
    assert result.driver == "580.95.05"
    assert nvml.shutdowns == 1


def test_no_driver_means_cpu_not_an_error():
    result = probe(FakeNvml(fail_init=OSError("NVML Shared Library Not Found")))
    assert result.platform == "cpu"
    assert "NVML Shared Library Not Found" in result.reason


def test_zero_devices_means_cpu():
    assert probe(FakeNvml(count=0)).platform == "cpu"


def test_tensor_parallel_larger_than_gpu_count_is_refused():
    gpus = probe(FakeNvml())
    assert check_parallelism(gpus, 8) is gpus
    with pytest.raises(GpuConfigError, match="tensor_parallel_size=16 but this host has 8"):
        check_parallelism(gpus, 16)

"""An NVML stand-in that describes any box; probe() takes it in place of pynvml."""

import time
from types import SimpleNamespace

GB = 10**9


class FakeNvml:
    class NVMLError_NotSupported(Exception):
        pass

    NVML_P2P_CAPS_INDEX_NVLINK = 2
    NVML_P2P_STATUS_OK = 0

    def __init__(self, count=8, name="NVIDIA RTX PRO 6000 Blackwell Server Edition", cc=(12, 0), total=96 * GB,
                 nvlink=False, fail_init=None, watts=300.0):
        self.count, self.name, self.cc, self.total, self.nvlink = count, name, cc, total, nvlink
        self.watts = watts
        self.fail_init = fail_init
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

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        """Millijoules since an arbitrary start, at `watts` per GPU: what a loaded GPU's counter does."""
        if self.watts is None:
            raise self.NVMLError_NotSupported()
        return int((time.monotonic() + 1000.0 * h) * self.watts * 1000)

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        assert index == self.NVML_P2P_CAPS_INDEX_NVLINK
        return self.NVML_P2P_STATUS_OK if self.nvlink else 4  # NVML_P2P_STATUS_NOT_SUPPORTED

"""The probe and the hardware rules against described NVMLs: 8x RTX PRO 6000 (SM120, 96 GB, PCIe),
8x H200 (SM90, 141 GB, NVLink), and a host without a driver."""

import time

import pytest
from fake_nvml import GB, FakeNvml

from tasks.gpu import HardwarePlan, check_hardware, energy_meter, hardware_warnings, kv_cache_is_fp8, probe

KIMI_INT4_BYTES = 595 * GB


def rtx_pro_6000():
    return probe(FakeNvml())


def h200():
    return probe(FakeNvml(name="NVIDIA H200", cc=(9, 0), total=141 * GB, nvlink=True))


def test_probe_describes_eight_sm120_gpus_on_pcie():
    nvml = FakeNvml()
    result = probe(nvml)
    assert result.platform == "cuda" and len(result.gpus) == 8
    assert {g.compute_capability for g in result.gpus} == {(12, 0)}
    assert result.gpus[0].name.startswith("NVIDIA RTX PRO 6000")
    assert result.gpus[3].memory_free_bytes == 92 * GB
    assert result.driver == "580.95.05"
    assert result.interconnect == "pcie"
    assert nvml.shutdowns == 1


def test_probe_sees_nvlink_on_h200():
    assert h200().interconnect == "nvlink"


def test_no_driver_means_cpu_not_an_error():
    result = probe(FakeNvml(fail_init=OSError("NVML Shared Library Not Found")))
    assert result.platform == "cpu"
    assert "NVML Shared Library Not Found" in result.reason
    assert check_hardware(result, HardwarePlan(8, KIMI_INT4_BYTES, kv_cache_fp8=True)) == []


def test_zero_devices_means_cpu():
    assert probe(FakeNvml(count=0)).platform == "cpu"


def test_kimi_int4_fits_both_boxes_at_tp8():
    plan = HardwarePlan(8, KIMI_INT4_BYTES, kv_cache_fp8=False)
    assert check_hardware(rtx_pro_6000(), plan) == []
    assert check_hardware(h200(), plan) == []


def test_fp8_kv_cache_is_blocked_on_sm120_only():
    plan = HardwarePlan(8, 540 * GB, kv_cache_fp8=True)  # the NVFP4 sibling with its FP8 KV cache
    rules = [v.rule for v in check_hardware(rtx_pro_6000(), plan)]
    assert rules == ["fp8-kv-cache-on-sm12x"]
    assert check_hardware(h200(), plan) == []


def test_weights_that_do_not_fit_at_low_tp_are_blocked():
    found = check_hardware(rtx_pro_6000(), HardwarePlan(4, KIMI_INT4_BYTES, kv_cache_fp8=False))
    assert [v.rule for v in found] == ["weights-exceed-gpu-memory"]
    assert "148.8 GB of weights per GPU at TP=4" in found[0].message


def test_tp_beyond_the_gpu_count_is_blocked_unless_it_spans_nodes():
    found = check_hardware(rtx_pro_6000(), HardwarePlan(16, KIMI_INT4_BYTES, kv_cache_fp8=False))
    assert "tp-exceeds-gpus" in [v.rule for v in found]
    two_boxes = HardwarePlan(16, KIMI_INT4_BYTES, kv_cache_fp8=False, nodes=2)  # 8 GPUs on each of 2 hosts
    assert two_boxes.gpus_needed == 8 and check_hardware(rtx_pro_6000(), two_boxes) == []
    assert two_boxes.layout == "TP=16 over 2 nodes"


def test_pcie_tensor_parallel_beyond_two_is_a_warning():
    plan = HardwarePlan(8, KIMI_INT4_BYTES, kv_cache_fp8=False)
    assert [w.rule for w in hardware_warnings(rtx_pro_6000(), plan)] == ["pcie-tensor-parallel"]
    assert hardware_warnings(h200(), plan) == []
    assert hardware_warnings(rtx_pro_6000(), HardwarePlan(2, 100 * GB, kv_cache_fp8=False)) == []


@pytest.mark.parametrize("scheme, dtype, fp8", [
    (None, "auto", False), ({"num_bits": 8, "type": "float", "strategy": "tensor"}, "auto", True),
    (None, "fp8_e4m3", True), ({"num_bits": 8, "type": "int"}, "auto", False),
])
def test_fp8_kv_cache_is_read_from_the_checkpoint_or_the_flag(scheme, dtype, fp8):
    assert kv_cache_is_fp8(scheme, dtype) is fp8


def test_the_energy_meter_reads_the_gpus_counters_in_joules():
    nvml = FakeNvml(count=8, watts=300.0)
    with energy_meter(4, nvml) as joules:
        before = joules()
        time.sleep(0.2)
        used = joules() - before
    assert used == pytest.approx(4 * 300.0 * 0.2, rel=0.25)  # four GPUs at 300 W for 0.2 s
    assert nvml.shutdowns == 1
    with energy_meter(8, FakeNvml(watts=None)) as none:  # a GPU without the counter
        assert none is None
    with energy_meter(8, FakeNvml(fail_init=RuntimeError("NVML Shared Library Not Found"))) as none:
        assert none is None


def test_the_gpus_a_server_uses_are_its_world_size_on_this_host():
    from tasks.deployment.stages import gpus_used
    from tasks.vllm.settings import VllmSettings

    assert gpus_used(rtx_pro_6000(), VllmSettings(tensor_parallel_size=8, enable_expert_parallel=True)) == 8
    assert gpus_used(rtx_pro_6000(), VllmSettings(tensor_parallel_size=2, data_parallel_size=2)) == 4
    assert gpus_used(rtx_pro_6000(), VllmSettings(data_parallel_size=16, data_parallel_size_local=8)) == 8
    assert gpus_used(probe(FakeNvml(fail_init=RuntimeError("no driver"))), VllmSettings()) is None


@pytest.fixture(scope="module")
def kimi_int4_roles(tmp_path_factory) -> tuple[int, int]:
    """Total and routed-expert bytes of a Kimi-K2.5 INT4-shaped checkpoint, from its validation summary."""
    from tasks.checkpoint.rules import validate_checkpoint
    from testkit.sparse import write_sparse_kimi

    model = tmp_path_factory.mktemp("kimi") / "kimi"
    write_sparse_kimi(model)
    report = validate_checkpoint(model)
    routed = sum(r["bytes"] for r in report.summary if r["role"] == "routed expert")
    return report.total_bytes, routed


def test_the_memory_model_places_experts_over_ep_ranks_and_the_rest_over_tp(kimi_int4_roles, capsys):
    total, routed = kimi_int4_roles
    layouts = {"TP=8 + EP": (8, 1, True), "TP=4 x DP=2 + EP": (4, 2, True), "TP=1 x DP=8 + EP": (1, 8, True),
               "TP=4": (4, 1, False)}
    survivors, lines = [], []
    for name, (tp, dp, ep) in layouts.items():
        plan = HardwarePlan(tp, total, kv_cache_fp8=False, data_parallel_size=dp, expert_parallel=ep,
                            routed_expert_bytes=routed)
        assert plan.layout == name
        found = check_hardware(rtx_pro_6000(), plan)
        lines.append(f"{name}: {plan.weights_per_gpu / 1e9:.1f} GB of weights per GPU: "
                     + ("fits" if not found else found[0].message))
        if not found:
            survivors.append(name)
    with capsys.disabled():  # the per-GPU figures, for a person reading the test run
        print("\n" + "\n".join(lines))
    # 594 GB, of which 571 GB routed experts: EP spreads them over all 8 GPUs; the other 24 GB are
    # divided by TP only, and copied on each DP rank. At TP=1 x DP=8 that copy no longer fits 96 GB.
    assert survivors == ["TP=8 + EP", "TP=4 x DP=2 + EP"]
    assert HardwarePlan(1, total, False, data_parallel_size=8, expert_parallel=True,
                        routed_expert_bytes=routed).weights_per_gpu == pytest.approx((total - routed) + routed / 8)


def test_fp8_kv_on_sm120_is_refused_or_only_warned_by_what_the_installed_vllm_takes():
    from tasks.vllm.options import mla_takes_fp8_kv

    old = HardwarePlan(8, 540 * GB, kv_cache_fp8=True, fp8_kv_on_sm12x=False)
    new = HardwarePlan(8, 540 * GB, kv_cache_fp8=True, fp8_kv_on_sm12x=True)
    assert [v.rule for v in check_hardware(rtx_pro_6000(), old)] == ["fp8-kv-cache-on-sm12x"]
    assert check_hardware(rtx_pro_6000(), new) == []
    assert "fp8-kv-cache-on-sm12x" in [w.rule for w in hardware_warnings(rtx_pro_6000(), new)]
    # vLLM 0.32's Triton MLA backend lists fp8 (PR #34597): this install only warns.
    assert mla_takes_fp8_kv() is True

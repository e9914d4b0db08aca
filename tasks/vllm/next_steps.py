"""What to try next when a vLLM start failed, per cause (causes.py): the line the deploy's operator
reads in the failure, before the log tail, with the numbers the log gives (the memory it lacked, the
flag to change, the capability the GPU has)."""

from __future__ import annotations

import re
from collections.abc import Callable

# What to try next, per cause: the deploy's operator reads this in the failure, before the log tail.
def _number(pattern: str, log: str) -> str | None:
    found = re.findall(pattern, log, re.IGNORECASE)
    return found[-1] if found else None


def _kv_cache_step(log: str) -> str:
    needed = _number(r"\(([\d.]+ ?[KMG]iB) KV cache is needed", log)
    available = _number(r"available KV cache memory \((-?[\d.]+ ?[KMG]iB)\)", log)
    fits = _number(r"estimated maximum model length is (\d+)", log)
    if needed and available:
        step = f"one request of max_model_len needs {needed} of KV cache, {available} is available: "
        step += (f"lower --max-model-len to {fits} or less" if fits else "lower --max-model-len")
        return step + ", or raise --gpu-memory-utilization (or add GPUs with tensor parallelism)"
    seq_len = _number(r"max seq len \((\d+)\) is larger than the maximum number of tokens", log)
    tokens = _number(r"tokens that can be stored in KV cache \((\d+)\)", log)
    if seq_len and tokens:
        return (f"max_model_len is {seq_len} tokens but the KV cache holds {tokens}: lower --max-model-len to "
                f"{tokens} or less, or raise --gpu-memory-utilization")
    negative = _number(r"Available KV cache memory: (-[\d.]+ ?GiB)", log)
    if negative:
        return (f"the weights and activations left {negative} for the KV cache: raise --gpu-memory-utilization, "
                "spread the model over more GPUs (tensor parallelism), or serve a smaller quantization; "
                "lowering --max-model-len alone will not help")
    return "the KV cache does not fit: lower --max-model-len or raise --gpu-memory-utilization"


def _memory_step(log: str) -> str:
    free = re.findall(r"Free memory on device[^(]*\(([\d.]+)/([\d.]+) GiB\) on startup is less than desired GPU "
                      r"memory utilization \(([\d.]+)", log)
    if free:
        avail, total, asked = (float(x) for x in free[-1])
        fits = int(avail / total * 100) / 100
        return (f"another process holds this GPU's memory: {avail:g} of {total:g} GiB free, "
                f"--gpu-memory-utilization {asked:g} asks for more: stop the other process or lower "
                f"--gpu-memory-utilization to {fits:.2f} or less")
    tried = _number(r"Tried to allocate ([\d.]+ ?[KMG]iB)", log)
    left = re.findall(r"total capacity of ([\d.]+ ?[KMG]iB) of which ([\d.]+ ?[KMG]iB) is free", log)
    where = f" (tried to allocate {tried} with {left[-1][1]} of {left[-1][0]} free)" if tried and left else ""
    return (f"the GPU ran out of memory{where}: lower --gpu-memory-utilization, --max-num-seqs or "
            "--max-num-batched-tokens, or raise --tensor-parallel-size; if it happened while loading weights "
            "the model does not fit these GPUs")


def _argument_step(log: str) -> str:
    if m := re.search(r"Total number of attention heads \((\d+)\) must be divisible by tensor parallel size "
                      r"\((\d+)\)", log):
        heads, size = int(m[1]), int(m[2])
        fits = [n for n in range(1, heads + 1) if heads % n == 0 and n <= max(size, 8)]
        return (f"--tensor-parallel-size {size} does not divide the model's {heads} attention heads: use one that "
                f"does ({', '.join(map(str, fits))}), and pipeline parallelism for the rest of the GPUs")
    if re.search(r"divisible by (?:the )?(?:tensor|pipeline|data|expert)[ _-]parallel", log, re.IGNORECASE):
        return ("a parallel size does not divide the model's heads or experts: choose a --tensor-parallel-size "
                "(or expert/data-parallel size) that divides them")
    if m := re.search(r"max_num_batched_tokens \((\d+)\) is smaller than max_model_len \((\d+)\)", log):
        return (f"--max-num-batched-tokens {m[1]} is below max_model_len {m[2]} with chunked prefill off: raise it to "
                f"{m[2]}, enable chunked prefill, or lower --max-model-len")
    if m := re.search(r"quantization method specified in the model config \((\w+)\) does not match the "
                      r"quantization method specified in the `?quantization`? argument \((\w+)\)", log,
                      re.IGNORECASE):
        return (f"--quantization {m[2]} contradicts the checkpoint's own {m[1]}: drop --quantization (vLLM reads it "
                "from the checkpoint) or give the one its config names")
    if m := re.search(r"Cannot find the config file for (\w+)", log):
        return (f"--quantization {m[1]} was asked of a checkpoint that is not {m[1]}-quantized: drop --quantization, "
                "or quantize the checkpoint first and serve that")
    quant_dtypes = _number(r"Supported dtypes: \[([^\]]+)\]", log)
    if refused := _number(r"does not support (float16|bfloat16|float32)\b", log):
        if quant_dtypes and refused in quant_dtypes:
            return (f"the quantization takes only {quant_dtypes.replace('torch.', '')} and the model refuses "
                    f"{refused}: no --dtype fits; serve another quantization of this model")
        return f"--dtype {refused} does not suit this model: pass --dtype bfloat16 (or float32)"
    if quant_dtypes:
        return f"--dtype does not suit the quantization: pass --dtype {quant_dtypes.replace('torch.', '')}"
    if re.search(r"trust_remote_code=True|requires you to execute the configuration file", log):
        return ("the model ships its own code: start with --trust-remote-code (after reading that code), or "
                "serve a checkpoint whose architecture this vLLM has built in")
    if m := re.search(r"got an unexpected keyword argument '(\w+)'", log):
        return (f"the installed vLLM takes no argument {m[1]}: the caller was written for another vLLM version; "
                "install the version it pins, or drop the argument")
    bad = _number(r"unrecognized arguments: (.+)", log)
    what = f" ({bad.strip()})" if bad else ""
    return (f"vLLM refused the command line{what}: check each flag against this version's `vllm serve --help`, "
            "flags are renamed and removed between versions")


def _max_len_step(log: str) -> str:
    asked = _number(r"max_model_len \((\d+)\) is greater than the derived", log)
    derived = _number(r"derived max_model_len \((?:[\w.]+=)?(\d+)", log)
    if asked and derived:
        return (f"--max-model-len {asked} is more than the model's config allows ({derived}): lower it to "
                f"{derived}, or give the model a rope scaling that supports more")
    return "--max-model-len is more than the model's config allows: lower it to the model's context length"


def _kernel_step(log: str) -> str:
    if m := re.search(r"out of resource: shared memory, Required: (\d+), Hardware limit: (\d+)", log):
        return (f"a Triton kernel's tile needs {m[1]} bytes of shared memory, this GPU has {m[2]}: use another MoE "
                "or attention backend, or a kernel config tuned for this GPU (VLLM_TUNED_CONFIG_FOLDER)")
    if re.search(r"no kernel image is available", log, re.IGNORECASE):
        return ("this vLLM/PyTorch build has no kernels for this GPU's compute capability: install a build made "
                "for it (for SM120/Blackwell, a CUDA 12.8+ build; on ROCm, one built for the GPU's gfx target)")
    return ("a CUDA kernel failed on this GPU: try another kernel path for the failing layer (another MoE or "
            "attention backend, --kv-cache-dtype auto instead of fp8, --disable-custom-all-reduce) and "
            "--enforce-eager to rule out CUDA graphs; CUDA_LAUNCH_BLOCKING=1 (AMD_SERIALIZE_KERNEL=3 on ROCm) "
            "shows the kernel that failed")


def _capability(number: str) -> str:
    """vLLM writes a capability as "80" in quantization checks and "8.0" elsewhere."""
    return number if "." in number else f"{number[:-1]}.{number[-1]}"


def _gpu_step(log: str) -> str:
    """What the GPU lacks, with the capabilities the log gives: a dtype has a flag that avoids it, a
    quantization needs another checkpoint (or another GPU)."""
    if m := re.search(r"Bfloat16 is only supported on GPUs with compute capability of at least (\d+(?:\.\d+)?)\. "
                      r"Your (.+?) GPU has compute capability (\d+(?:\.\d+)?)", log):
        return (f"bfloat16 needs compute capability {m[1]}, this {m[2]} has {m[3]}: start with --dtype half "
                "(float16), or use a newer GPU")
    needs = re.search(r"Min(?:imum)? capability: (\d+)\W+Current capability: (\d+)", log)
    method = _number(r"quantization method (\w+) is not supported for the current GPU", log)
    if needs:
        what = f"the {method} quantization" if method else "this checkpoint's quantization scheme"
        return (f"{what} needs compute capability {_capability(needs[1])}, this GPU has {_capability(needs[2])}: "
                "serve a checkpoint quantized in a scheme this GPU supports (vLLM's supported-hardware table for "
                "quantization), or move to a GPU that has the capability")
    if re.search(r"fp8e4nv not supported in this architecture", log, re.IGNORECASE):
        return ("this GPU has no FP8 (e4m3) support, which a kernel of this FP8 checkpoint needs (compute "
                "capability 8.9+): serve a BF16 or INT4/INT8 (AWQ, GPTQ) checkpoint, or a vLLM version whose "
                "Marlin FP8 fallback covers this layer")
    if re.search(r"compressed_tensors|_check_scheme_supported", log):
        return ("this checkpoint's compressed-tensors scheme needs a higher compute capability than this GPU has: "
                "serve a checkpoint in a scheme this GPU supports (vLLM's supported-hardware table for "
                "quantization), or move to a newer GPU")
    return ("this GPU's compute capability is below what the checkpoint's quantization, dtype or kernel needs: "
            "serve a checkpoint this GPU supports (another quantization, --dtype half), or use a newer GPU")


def _unsupported_step(log: str) -> str:
    if re.search(r"not divisible by min_thread_[kn]", log):
        return ("a layer's shape does not fit the Marlin kernel's tiles at this tensor-parallel size: lower "
                "--tensor-parallel-size, or serve with the plain kernel its message names (--quantization awq/gptq)")
    if re.search(r"not a registered model in the Transformers library|Cannot find model module", log):
        return ("neither this vLLM nor the installed Transformers knows the checkpoint's architecture: upgrade vLLM "
                "(and transformers) to a version that lists it, or pass --trust-remote-code when the checkpoint "
                "ships its own modeling code (auto_map in config.json)")
    return ("this vLLM cannot serve this model or its quantization on this GPU: check the architecture and "
            "quantization_config against vLLM's supported models, upgrade vLLM, or choose a checkpoint with a "
            "kernel for this GPU")


def _install_step(log: str) -> str:
    if m := re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", log):
        if not m[1].startswith("vllm"):
            return (f"Python cannot import {m[1].split('.')[0]}, which this start needs: install the version that "
                    "this vLLM pins (its requirements, or the extra the model card names) in vLLM's environment")
    if m := re.search(r"ImportError: (.*\b(?:install|version)\b.*)", log):
        return (f"a package this start imports is missing or of the wrong version ({m[1].strip()[:120]}): "
                "install the version it asks for in vLLM's environment")
    if re.search(r"Device string must not be empty|Failed to infer device type", log):
        return ("vLLM found no GPU platform: install the vLLM build for this GPU (the ROCm build on AMD, the CUDA "
                "one on NVIDIA), and in a container make the GPU visible (--gpus all; nvidia-smi inside it)")
    return ("vLLM's compiled kernels do not load here: the vLLM wheel was built for another torch or CUDA, "
            "or the install is partial; reinstall vLLM in a fresh environment with the torch it pins, "
            "and do not upgrade torch over it")


def _compile_step(log: str) -> str:
    if re.search(r"flashinfer|topk_topp_sampler", log, re.IGNORECASE):
        return ("FlashInfer's JIT could not build a kernel: install a CUDA toolkit (nvcc) that knows this GPU and "
                "matches the wheel's CUDA (an sm_120 needs 12.9+), or FlashInfer's prebuilt kernels "
                "(flashinfer-cubin, flashinfer-jit-cache); clear ~/.cache/flashinfer; or avoid the FlashInfer "
                "path (VLLM_USE_FLASHINFER_SAMPLER=0, another --attention-backend, --kv-cache-dtype auto)")
    if re.search(r"ld: cannot find -lcuda", log):
        return ("a kernel build at start (Triton's launcher, torch.compile) could not link against the driver's "
                "libcuda: install the NVIDIA driver's libcuda.so where the linker finds it (ldconfig; in a "
                "container the NVIDIA runtime), or set TRITON_LIBCUDA_PATH to its directory; or start with "
                "--enforce-eager to skip compilation")
    if re.search(r"nvcc: not found|Could not find nvcc|toolkit headers are incompatible|requires CUDA >=", log):
        return ("a kernel is JIT-built at start (FlashInfer) and no fitting CUDA toolkit (nvcc) was found: install the "
                "toolkit of torch's CUDA (12.9+ for an sm_120) and set CUDA_HOME, or FlashInfer's prebuilt "
                "kernels (flashinfer-cubin, flashinfer-jit-cache), or VLLM_USE_FLASHINFER_SAMPLER=0")
    return ("compiling kernels failed (torch.compile, Triton or FlashInfer's JIT): clear "
            "~/.cache/vllm/torch_compile_cache and ~/.cache/flashinfer, check that nvcc matches the CUDA "
            "of the wheel, or start with --enforce-eager (-O0) to skip compilation")


NEXT_STEPS: dict[str, str | Callable[[str], str]] = {
    "port-in-use": "another process listens on the port (often a vLLM that was not stopped): stop it or choose "
                   "another --port",
    "invalid-argument": _argument_step,
    "max-model-len-too-long": _max_len_step,
    "hub-access": "the model could not be fetched from the Hugging Face Hub: without network, give --model the "
                  "local snapshot directory (or HF_HUB_OFFLINE=1 with a complete cache); for a gated or private "
                  "repo accept its licence and set HF_TOKEN; check the model id and any HTTPS_PROXY/HF_ENDPOINT",
    "model-config": "the model's files are not what vLLM needs: check that the checkpoint directory holds the "
                    "model's own config.json, valid JSON with `architectures` and `model_type`, its tokenizer "
                    "files and its weights (an interrupted download, an adapter-only or tokenizer-only repo has "
                    "neither), or point "
                    "--hf-config-path at the config",
    "cuda-driver": "the NVIDIA driver cannot run this build's CUDA: compare nvidia-smi's \"CUDA Version\" (the newest "
                   "it runs) with torch.version.cuda, then upgrade the driver or install a vLLM/torch build for an "
                   "older CUDA; in a container use the NVIDIA runtime (--gpus all); on NVSwitch machines error 802 "
                   "means nvidia-fabricmanager is not running",
    "cuda-fork": "vLLM's workers were forked from a process that had already initialised CUDA: set "
                 "VLLM_WORKER_MULTIPROC_METHOD=spawn, and touch no CUDA (torch.cuda, a model) before vLLM starts; "
                 "a script that starts vLLM needs its code under `if __name__ == \"__main__\":`",
    "gpu-capability": _gpu_step,
    "out-of-memory": _memory_step,
    "kv-cache-too-small": _kv_cache_step,
    "nccl": "NCCL failed between the ranks: rerun with NCCL_DEBUG=INFO, check the GPUs' peer access and the "
            "shared memory (--ipc=host, --shm-size), try NCCL_P2P_DISABLE=1 or --disable-custom-all-reduce, or "
            "lower --tensor-parallel-size to find the bad link",
    "cuda-graph-capture": "CUDA graph capture failed: start with --compilation-config "
                          "'{\"cudagraph_mode\": \"PIECEWISE\"}', or --enforce-eager to start without CUDA graphs",
    "weights-mismatch": "the checkpoint's tensors do not match this vLLM's model for the architecture: a loader "
                        "regression of this vLLM version (try the version the model card names, or a newer one), "
                        "or a checkpoint converted or quantized in a layout vLLM does not read (check its "
                        "quantization_config and the tool that made it); pipeline or expert parallelism change "
                        "which names a rank loads: try without them to tell",
    "not-enough-gpus": "vLLM was asked for more GPUs than this process can see: check CUDA_VISIBLE_DEVICES and the "
                       "container's GPUs (nvidia-smi inside it), that --tensor-parallel-size x "
                       "--pipeline-parallel-size fits them, and for Ray that every node joined with its GPUs",
    "broken-install": _install_step,
    "cuda-kernel-error": _kernel_step,
    "compile-failed": _compile_step,
    "unsupported-model": _unsupported_step,
    "engine-failed": "the engine died of an error no rule here names: the line above is its last exception where "
                     "it printed one; read the engine's and workers' lines above \"EngineCore failed to start\", "
                     "or rerun with VLLM_LOGGING_LEVEL=DEBUG",
    "group-incomplete": "not every rank joined the group: read the secondary nodes' logs, and check that they reach "
                        "the leader's --master-addr and ports and run the same vLLM",
    "startup-timeout": "vLLM was still starting: read how far the log got; a large MoE model can take 10-15 "
                       "minutes to load, raise the start timeout if it was still making progress",
}


def next_step(cause: str, log: str = "") -> str:
    """One line saying what to change before the next try, with the numbers the log gives."""
    step = NEXT_STEPS.get(cause)
    if step is None:
        return "vLLM exited: read its last error line and the log tail"
    return step(log) if callable(step) else step

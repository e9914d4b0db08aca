"""The causes a failed vLLM start is named by, the log lines that show each, and what to try next.

A cause is named by what the error means, as vLLM, PyTorch, NCCL, Triton or FlashInfer word it, so that
the operator's next step fits it: a GPU too old for a checkpoint's quantization needs another checkpoint,
a kernel build that fails needs a toolkit or a cache cleared, and neither is helped by "vLLM exited".
The rules were written against real start-up logs from GPU machines quoted in public issues
(tests/fixtures/vllm_logs, docs/failure-causes.md), and scored on a second batch read only afterwards.
What to try next for each cause is in next_steps.py.
"""

from __future__ import annotations

import re

# Causes a line names outright; the first cause in this order that any error line matches wins, so a
# specific message beats the generic CUDA error text printed with it ("NCCL error: unhandled cuda error",
# "CUDA error: operation not permitted when stream is capturing", "CUDA error: out of memory").
# Matching is case-insensitive: "Address already in use" and uvicorn's "address already in use".
FAILURE_CAUSES = [
    ("port-in-use", r"address already in use|EADDRINUSE|\[Errno 98\]"),
    # The command line itself, or a flag the model needs or cannot take: a tensor-parallel size that
    # does not divide the model's heads, remote code the command did not trust.
    ("invalid-argument", (r"unrecognized arguments|error: argument|invalid choice|the following arguments are "
                          r"required|provide the model as a positional argument|"
                          r"(?:must be|is not|not) divisible by (?:the )?(?:tensor|pipeline|data|expert)[ _-]parallel|"
                          r"set the option `?trust_remote_code=True|consider setting `?trust_remote_code=True|"
                          r"requires you to execute the configuration file|contains custom code which must be "
                          r"executed|max_num_batched_tokens \(\d+\) is smaller than max_model_len|"
                          r"does not match the quantization method specified|"
                          r"got an unexpected keyword argument|Cannot find the config file for \w+|"
                          r"is not supported for quantization method|does not support (?:float16|bfloat16|float32)\b")),
    # More GPUs asked for than this process can see (CUDA_VISIBLE_DEVICES, the container, Ray's placement).
    ("not-enough-gpus", (r"number of required GPUs exceeds|must be less than or equal to the number of visible devices|"
                         r"No CUDA GPUs are available|has no GPU available|does not allocate any GPUs|"
                         r"invalid device ordinal")),
    ("max-model-len-too-long", r"max_model_len \(\d+\) is greater than the derived"),
    # The NVIDIA driver cannot run this build's CUDA (too old, missing in the container, a broken
    # driver/library pair, NVSwitch's fabric manager not up): before the generic CUDA error it comes in.
    ("cuda-driver", (r"CUDA driver version is insufficient|NVIDIA driver on your system is too old|"
                     r"Found no NVIDIA driver|unsupported display driver / cuda driver combination|"
                     r"forward compatibility was attempted on non supported HW|Error 802: system not yet "
                     r"initialized|Unexpected error from cudaGetDeviceCount|cudaErrorInsufficientDriver")),
    # A worker forked from a process that had already initialised CUDA cannot use it.
    ("cuda-fork", r"Cannot re-initialize CUDA in forked subprocess"),
    # The Hugging Face Hub cannot be reached or refuses the repo (offline, no DNS, gated or private without a
    # token): before model-config, whose "no config.json" the same failure prints.
    ("hub-access", (r"OfflineModeIsEnabled|GatedRepoError|Cannot access gated repo|401 Client Error|"
                    r"Access to model \S+ is restricted|is gated\. You must be authenticated|RepositoryNotFoundError|"
                    r"(?:connect to|reach) '?https://huggingface\.co|(?:host=|Failed to resolve )\\?'huggingface\.co")),
    # The checkpoint's own files: a config missing, not JSON or naming no architecture, no weights where
    # vLLM looks. vLLM raises some inside its pydantic ModelConfig check, so they come before the
    # ValidationError catch-all at the end.
    ("model-config", (r"No model architectures are specified|Value error, Expecting value: line \d+|JSONDecodeError|"
                      r"Error loading config|Invalid repository ID|Unrecognized model in|"
                      r"should have a `?model_type`? key|Can't load (?:the )?configuration|"
                      r"config\.json\W*(?:not found|does not exist)|No supported config format found|"
                      r"Could not detect config format|does not appear to have a file named|"
                      r"Cannot find any model weights|Failed to load the tokenizer|Can't load tokenizer|"
                      r"No tokenizer file found|SafetensorError|Error while deserializing header|"
                      # huggingface_hub's word for a --model that is neither a directory here nor a repo id
                      r"Repo id must be in the form")),
    # The GPU is older than what the checkpoint's quantization, dtype or kernel needs; checked before the
    # generic "not supported" of unsupported-model and before a Triton CompilationError that only wraps it.
    ("gpu-capability", (r"not supported for the current GPU|(?:Min(?:imum)?|Current) capability: \d+|"
                        r"Bfloat16 is only supported on GPUs|You can use float16 instead by explicitly setting|"
                        r"for a compute capability less than|current device does not support this kernel|"
                        r"compute capability (?:of at least|below|>=?) ?\d|"
                        r"only supports? \w+ GPUs or newer|not supported in this architecture|"
                        r"(?:not supported|unsupported) on (?:this|your|the current) GPU|"
                        r"compute capability not supported")),
    ("out-of-memory", (r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|Cuda failure 'out of memory'|"
                       r"cudaErrorMemoryAllocation|Free memory on device .* is less than desired GPU memory "
                       r"utilization|Not enough memory|insufficient memory")),
    ("kv-cache-too-small", (r"KV cache is needed, which is larger than the available KV cache memory|larger than the "
                            r"maximum number of tokens that can be stored in KV cache|No available memory for the "
                            r"cache blocks|To serve at least one request with the models?'s max seq len")),
    # torch's NCCL watchdog: a collective that never completed (a rank that never joined, a hung link).
    ("nccl", (r"NCCL error|nccl\w*Error\b|ncclInternalError|ncclSystemError|"
              r"Watchdog caught collective operation timeout|ncclCommWatchdog|ProcessGroupNCCL's watchdog")),
    ("cuda-graph-capture", (r"cudaErrorStreamCapture|CUDA_ERROR_STREAM_CAPTURE|when stream is capturing|due to a "
                            r"previous error during capture|CUDAGraphMode\.\w+ is not supported|capture cuda graph "
                            r"failed|CUDA graph capture failed")),
    # A checkpoint tensor with no parameter of that name in vLLM's model (a loader regression, or a
    # checkpoint converted or quantized in a layout this vLLM does not read).
    # V0's engine logs a KeyError as its bare key: "ERROR ... engine.py:366] 'layers.0.mlp.down_proj.weight'".
    ("weights-mismatch", (r"KeyError: '\w+(?:\.\w+)*\.\d+\.[\w.]+'?|KeyError: '[\w.]+\.(?:weight|bias)'|"
                          r"\] '\w+(?:\.\w+)*\.\d+\.[\w.]+'\s*$|"
                          r"no module or parameter named|param = params_dict\[name\]")),
    # vLLM's compiled ops do not load: a wheel built against another torch or CUDA, or a partial install;
    # or a package the start imports is missing or of another version (raised, not a logged fallback).
    ("broken-install", (r"'_OpNamespace' '\w+' object has no attribute|undefined symbol: |"
                        r"ModuleNotFoundError: No module named|"
                        r"ImportError: (?:cannot import name|.*\b(?:install|version)\b)|"
                        r"Device string must not be empty|Failed to infer device type|"
                        r"No module named '(?:vllm\.)?_\w*C'|No module named 'vllm(?:\.(?!_version)\w+)*'|"
                        r"cannot open shared object file")),
    # ROCm words the same errors as HIP's: "HIP error: invalid argument", hipErrorNoBinaryForGpu.
    ("cuda-kernel-error", (r"illegal memory access|no kernel image is available|AcceleratorError|"
                           r"\b(?:CUDA|HIP) error\b|\bhipError\w+|(?:CUDA|HIP) kernel errors might be asynchronously|"
                           r"TORCH_USE_(?:CUDA|HIP)_DSA|"
                           r"\bcudaError\w+|CUDA_ERROR_\w+|misaligned address|device-side assert(?:ion)? triggered|"
                           r"illegal instruction|unspecified launch failure|"
                           r"out of resource: shared memory|OutOfResources")),
    # FlashInfer JIT-builds kernels on first use; with no nvcc, or one too old for the GPU, the build or
    # its architecture check fails ("requires GPUs with sm75 or higher" on an sm_120 with CUDA < 12.9).
    ("compile-failed", (r"CompilationError|InductorError|BackendCompilerFailed|torch\._inductor\.exc|"
                        r"Ninja build failed|ninja: build stopped|nvcc fatal|/bin/nvcc |Error building extension|"
                        r"flashinfer\.jit.*(?:fail|error)|FlashInfer requires (?:GPUs with )?sm\d+|"
                        r"No supported CUDA architectures found|triton\.runtime\.errors|"
                        r"loc\(\"[^\"]+\":\d+:\d+\): error:|ptxas fatal|Ptx assembly aborted|ptxas .*\berror\b|"
                        r"torch\._dynamo\.exc\.\w+|\berror: [\w./-]+\.py:\d+:\d+: |"
                        # Dynamo's trailer under its error, whose own line a quote may cut; a JIT build's link
                        r"Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace|collect2: error: ld returned|"
                        r"/ld: cannot find -l\w+|"
                        # a JIT build at start with no CUDA toolkit, or one that does not fit the GPU or itself
                        r"nvcc: not found|Could not find nvcc|CUDA compiler and CUDA toolkit headers are "
                        r"incompatible|SM \d+\.?\w* requires CUDA >= ?[\d.]+|"
                        # ptxas (Triton's or the toolkit's) that does not know the GPU's architecture
                        r"Value 'sm_\w+' is not defined for option 'gpu-name'")),
    ("unsupported-model", (r"Model architectures? .* (?:are|is) not supported|does not recognize this architecture|"
                           r"Error in inspecting model architecture|failed to be inspected|"
                           r"is not a registered model in the Transformers library|Cannot find model module|"
                           r"not divisible by min_thread_[kn]|size_k must divisible by|is not divisible by tile_[kn]_size|"
                           r"No \w+ (?:MoE )?backend supports|not supported for now|Unsupported CPU attention|"
                           # no attention backend for the model and GPU: none valid, or the one asked for needs more
                           r"No valid attention backend found|(?-i:\b[A-Z][A-Z0-9]*_[A-Z0-9_]+ requires an? )|"
                           # features that cannot be combined for the model (a hybrid model's KV cache offloaded)
                           r"failed to convert the KV cache specs to one unified type|"
                           r"NotImplementedError: \S|"
                           r"does not support \w+ quantization|No compressed-tensors compatible scheme|"
                           r"(?:Error|Exception): .*(?:\b(?:not supported|unsupported|does not support)\b|"
                           r"\bonly\b.* (?:are|is) supported)")),
    # A pydantic check of vLLM's config that none of the above names is still the command's fault.
    ("invalid-argument", r"ValidationError|\[type=value_error"),
]
CAUSES = [(cause, re.compile(pattern, re.IGNORECASE)) for cause, pattern in FAILURE_CAUSES]

# When no line names the cause: what the engine logged last before dying.
NEGATIVE_KV = re.compile(r"Available KV cache memory: -[\d.]+ ?GiB")
# A quoted log often stops inside the traceback, before the exception's own line; the frames it went
# through still say which step failed. In this order: graph capture, a kernel build (Inductor's code
# generation, FlashInfer's JIT, torch's ninja build), a quantization scheme's GPU check, the set-up of
# the tensor-parallel group's communicators (NCCL).
FRAMES = [
    ("cuda-graph-capture", re.compile(r", in (?:capture_model|_capture_cudagraphs|capture|capture_begin|capture_end)"
                                      r"\s*$")),
    # vLLM's CUDA top-k/top-p sampler is FlashInfer's, which builds its module on first use, in the
    # engine's dummy sampler run: a start that dies in it (with no other cause named) died building it.
    ("compile-failed", re.compile(r"torch/_inductor/(?:compile_fx|graph|scheduler|codecache|async_compile|lowering|"
                                  r"codegen/\w+)\.py\", line \d+|triton/compiler/compiler\.py\", line \d+|"
                                  r"flashinfer/jit/|\.build_and_load\(\)|\b_?run_ninja(?:_build)?\b|"
                                  r", in _jit_compile\b|\bflashinfer_sample\(|flashinfer/sampling\.py\"|"
                                  r"\bget_sampling_module\b|self\.topk_topp_sampler\(|"
                                  r"topk_topp_sampler\.py\", line \d+, in forward_cuda|"
                                  r"torch/_dynamo/(?:convert_frame|symbolic_convert|output_graph)\.py\", line \d+")),
    ("gpu-capability", re.compile(r"_check_scheme_supported|get_min_capability\(\)|_check_if_gpu_supports_dtype")),
    ("nccl", re.compile(r"PyNcclCommunicator\(|pynccl\w*\.py\"|ncclCommInitRank|, in init_model_parallel_group\b|"
                        r"return GroupCoordinator\(|, in init_worker_distributed_environment\b|"
                        r", in ensure_model_parallel_initialized\b|custom_all_reduce\.py\", line \d+|"
                        r", in tensor_model_parallel_all_(?:reduce|gather)\b|"
                        r"parallel_state\.py\", line \d+, in (?:all_reduce|all_gather|broadcast)\b|"
                        r"distributed_c10d\.py\", line \d+, in (?:all_reduce|all_gather\w*|broadcast\w*|barrier)\b")),
    # The API server's traceback cut as it builds the engine client: the engine did not come up.
    ("engine-failed", re.compile(r", in build_async_engine_client(?:_from_engine_args)?\s*$|"
                                 r"\bin wait_for_engine_startup\b")),
    # A socket's bind: the address or port is taken (or not this host's).
    ("port-in-use", re.compile(r"zmq/sugar/socket\.py\", line \d+, in bind\b|\w+socket\.bind\(")),
]

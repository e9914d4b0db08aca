"""What the swap's downtime is made of, and what cuts it: vLLM starts side by side in one run.

From the old server's stop to the new one's first answer the host serves nothing; most of that is
the new server's start. This starts vLLM (CPU build) on a generated checkpoint big enough that
loading is bound by the disk (GB_TARGET GB of bf16 Llama weights), and times each start to its
first answer:

- cold (page cache dropped) against prewarmed (the shards read into the page cache first, as
  the deploy does while the old server still answers; the read's own time is printed apart);
- vLLM's load strategies on a cold cache: lazy (mmap, its default on a local disk), eager,
  prefetch; and its other loaders where their packages are installed (`pip install -e
  ".[loaders]"`): `--load-format runai_streamer` (Run:ai Model Streamer) and `fastsafetensors`;
- torch.compile's cache cold against warm (compilation on, the deploy's cache on the models disk:
  fresh, then the same again; on the CPU build that is Inductor's own cache, beside VLLM_CACHE_ROOT);
- a rollback's start (the model just stopped: its pages and compile cache warm) against its cold
  start.

The page cache is dropped as root (`sync; echo 3 > /proc/sys/vm/drop_caches`) before each cold
start; the output says whether that worked here. Run from the repository root:

    .venv/bin/python benchmarks/swap.py [GB_TARGET]      # default 3
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flows.demo.checkpoint import train_tokenizer
from tasks.cpus import server_and_client_cpus
from tasks.deployment.stages import compile_cache_env
from tasks.errors import ServerStartError
from tasks.prewarm import prewarm
from tasks.vllm.command import build_command, check_arguments
from tasks.vllm.process import prestart_server, stop_server, wait_imported
from tasks.vllm.readiness import running_facts, start_and_wait
from tasks.vllm.settings import ServerConfig

# vLLM's process layout: its default (the API server, the engine core and a worker, each a process:
# as GPU hosts run it; the CPU build starts each with `spawn`, so each imports vLLM again), and the
# demo's (the worker inside the engine core's process, VLLM_ENABLE_V1_MULTIPROCESSING=0).
LAYOUTS = {"vLLM's default layout": {}, "the demo's layout": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}
HIDDEN, INTERMEDIATE, VOCAB = 2048, 5632, 1024
LAYER_BYTES = 2 * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE)


def drop_caches() -> bool:
    """Drop the page cache; False where this machine does not allow it (not root, a container)."""
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def big_checkpoint(folder: Path, gb: float) -> Path:
    """A Llama checkpoint of about `gb` GB of random bf16 weights and a locally trained tokenizer."""
    import torch
    from safetensors.torch import save_file

    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True)
    layers = max(1, round(gb * 1e9 / LAYER_BYTES))
    train_tokenizer(folder, VOCAB, seed=0)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": INTERMEDIATE, "num_hidden_layers": layers, "num_attention_heads": 32,
              "num_key_value_heads": 32, "vocab_size": VOCAB, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
              "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    shard, index, tensors = 0, {}, {"model.embed_tokens.weight": rand(VOCAB, HIDDEN),
                                     "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
                                     "lm_head.weight": rand(VOCAB, HIDDEN)}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        tensors |= {p + f"self_attn.{n}_proj.weight": rand(HIDDEN, HIDDEN) for n in "qkvo"}
        tensors |= {p + "mlp.gate_proj.weight": rand(INTERMEDIATE, HIDDEN), p + "mlp.up_proj.weight":
                    rand(INTERMEDIATE, HIDDEN), p + "mlp.down_proj.weight": rand(HIDDEN, INTERMEDIATE),
                    p + "input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
                    p + "post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}
        if layer % 4 == 3 or layer == layers - 1:  # shards of ~400 MB, as real checkpoints split
            name = f"model-{shard:05d}.safetensors"
            save_file(tensors, folder / name, metadata={"format": "pt"})
            index |= {key: name for key in tensors}
            shard, tensors = shard + 1, {}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return folder


def launch_config(model: Path, *, port: int = 0, **settings) -> ServerConfig:
    server_cpus, _ = server_and_client_cpus()
    env = {"VLLM_CPU_OMP_THREADS_BIND": server_cpus, **settings.pop("env", {})}
    return ServerConfig(model_path=model, served_model_name="swap", port=port, max_model_len=1024, cpus=server_cpus,
                        kv_cache_memory_bytes=2**30, env=env, **settings)


def start(model: Path, run_dir: Path, **settings) -> float:
    """Seconds from launch to the first answer (readiness includes a real token); then stopped."""
    handle = start_and_wait(launch_config(model, **settings), run_dir, timeout_s=900, poll_s=0.25)
    try:
        facts = running_facts(handle)
    finally:
        stop_server(handle)
    phases = ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in facts.phases.items() if k != "startup_s")
    print(f"    ready in {handle.startup_s:6.1f} s  ({phases})", flush=True)
    return handle.startup_s


def swap(old_model: Path, new_model: Path, run_dir: Path, *, prewarmed: bool, prestarted: bool,
         env: dict[str, str]) -> float:
    """One swap as the deploy makes it, on one port: the old model serving, the new model's pages
    dropped; then (as chosen) the new shards read into the page cache and the new vLLM imported and
    held at its gate, both while the old one answers; then the stop. Returns the seconds from the
    old server's stop to the new one's first answer: what the host's clients go without."""
    port = free_port()
    old = start_and_wait(launch_config(old_model, port=port, enforce_eager=True, env=env), run_dir / "old",
                         timeout_s=900)
    new_cfg = launch_config(new_model, port=port, enforce_eager=True, env=env)
    check_arguments(build_command(new_cfg, port), run_dir / "new")  # the deploy vets it during the download
    pre = None
    try:
        drop_caches()
        if prewarmed:
            print(f"    prewarm (the old one answering): {prewarm(new_model, margin_bytes=2 * 2**30).text()}")
        if prestarted:
            pre = prestart_server(new_cfg, run_dir / "new")
            print(f"    prestart (the old one answering): vLLM imported in {wait_imported(pre, 300):.1f} s, held")
    finally:
        stopped = time.monotonic()
        stop_server(old)
    stop_s = time.monotonic() - stopped
    new = start_and_wait(new_cfg, run_dir / "new", timeout_s=900, prestarted=pre, poll_s=0.25)
    unavailable = time.monotonic() - stopped
    stop_server(new)
    print(f"    unavailable {unavailable:6.1f} s  (the old server's stop {stop_s:.1f}, "
          f"the new start {new.startup_s:.1f})", flush=True)
    return unavailable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    gb = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
    work = Path(tempfile.mkdtemp(prefix="swap-bench-", dir=Path.cwd()))
    try:
        model = big_checkpoint(work / "big", gb)
        size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
        dropped = drop_caches()
        print(f"checkpoint: {size / 1e9:.2f} GB in {len(list(model.glob('*.safetensors')))} shards; "
              f"page cache drop: {'works (root)' if dropped else 'NOT possible here: cold figures are warm'}")
        run_dir = work / "run"
        eager = dict(enforce_eager=True)

        old_model = big_checkpoint(work / "old", 0.3)  # the model the host serves before the swap
        downtime = {}
        for layout, env in LAYOUTS.items():
            for name, prewarmed, prestarted in (("cold", False, False), ("prewarmed", True, False),
                                                ("prewarmed and prestarted", True, True)):
                print(f"swap, {name} ({layout}):", flush=True)
                downtime[layout, name] = swap(old_model, model, work / "swap", prewarmed=prewarmed,
                                              prestarted=prestarted, env=env)

        print("cold start (lazy, vLLM's default):", flush=True)
        drop_caches()
        cold = start(model, run_dir, **eager)
        print("prewarmed start (shards read into the page cache while the old server would still answer):")
        drop_caches()
        warmed = prewarm(model, margin_bytes=2 * 2**30)
        print(f"    prewarm: {warmed.text()}")
        prewarmed = start(model, run_dir, **eager)
        strategies: dict[str, float | str] = {"lazy": cold}
        for strategy in ("eager", "prefetch"):
            print(f"cold start, --safetensors-load-strategy {strategy}:", flush=True)
            drop_caches()
            strategies[strategy] = start(model, run_dir, safetensors_load_strategy=strategy, **eager)
        print("rollback start (the model just stopped: its pages still cached):", flush=True)
        rollback = start(model, run_dir, **eager)
        loaders = (("runai_streamer", "runai_model_streamer"), ("fastsafetensors", "fastsafetensors"))
        for load_format, package in loaders:
            print(f"cold start, --load-format {load_format}:", flush=True)
            if importlib.util.find_spec(package) is None:
                strategies[load_format] = f"not installed ({package})"
                print(f"    {strategies[load_format]}")
                continue
            drop_caches()
            try:
                strategies[load_format] = start(model, run_dir, load_format=load_format, **eager)
            except ServerStartError as exc:
                strategies[load_format] = f"failed: {exc}"
                print(f"    {strategies[load_format]}")

        prewarm(model, margin_bytes=2 * 2**30)  # both compile starts with the pages warm: the cache is the difference
        cache = compile_cache_env(work / "vllm-cache", "cpu")  # the deploy's: vLLM's and Inductor's on one disk
        print("with torch.compile, compile cache cold (a fresh cache on the models disk; pages warm):", flush=True)
        compile_cold = start(model, run_dir, env=cache)
        print("the same, compile cache warm (same root):", flush=True)
        compile_warm = start(model, run_dir, env=cache)

        print()
        for layout in LAYOUTS:
            cold_s = downtime[layout, "cold"]
            for name in ("prewarmed", "prewarmed and prestarted"):
                print(f"swap downtime ({layout}), {name} / cold: {downtime[layout, name]:6.1f} s / {cold_s:6.1f} s "
                      f"= x{downtime[layout, name] / cold_s:.2f}")
        print(f"cold load / prewarmed load:            {cold:6.1f} s / {prewarmed:6.1f} s = x{cold / prewarmed:.2f}"
              f"   (the prewarm's {warmed.seconds:.1f} s ran before the stop)")
        for name, seconds in strategies.items():
            print(f"loader {name:15s} (cold):        " + (f"{seconds:6.1f} s = x{seconds / cold:.2f} of lazy"
                                                          if isinstance(seconds, float) else seconds))
        print(f"compile cache cold / warm:             {compile_cold:6.1f} s / {compile_warm:6.1f} s "
              f"= x{compile_cold / compile_warm:.2f}")
        print(f"rollback start / cold start:           {rollback:6.1f} s / {cold:6.1f} s = x{rollback / cold:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    main()

"""Our client's ingest ceiling against `vllm bench serve`'s, on the same server in the same run.

A local OpenAI-compatible server in its own process streams tokens as fast as it can (no delays,
32 events per write), so what limits each run is the client: how many streamed tokens per second
it can take in, timestamp and account for. At 1, 64 and 256 concurrent streams, each tool runs the
same requests (16-token prompts, TOTAL_TOKENS / streams output tokens each, between 2,000 and
20,000: `vllm bench serve` fails a single 500,000-token stream, and a ratio needs both tools to
finish; ignore_eos, one warm-up per stream), and both report output tokens per second from the
server's usage counts. "ours+usage" is our default, per-chunk usage on, which makes every event
larger. Where the peer fails, the line says what failed instead of a ratio; --plant-peer-failure
points the peer at a port where nothing listens, to show that.

    .venv/bin/python benchmarks/client.py [TOTAL_TOKENS] [--plant-peer-failure]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from flows.demo.checkpoint import train_tokenizer
from tasks.bench.load import run_level
from tasks.bench.spec import BenchSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # testkit: not installed

from testkit.openai_server import StreamingServer  # noqa: E402

STREAMS = (1, 64, 256)
VLLM_BENCH = "import sys, argparse; from vllm.benchmarks.serve import add_cli_args, main; " \
             "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"


MAX_OUTPUT_LEN = 20_000  # the longest stream both tools complete (shared/notes/field-facts.md)


def ours(base_url: str, streams: int, output_len: int, continuous_usage: bool) -> float:
    """All requests at once, counted over the whole level, as the peer counts them."""
    spec = BenchSpec(input_len=16, output_len=output_len, requests_per_level=streams, level_duration_s=None,
                     continuous_usage=continuous_usage)
    return run_level(base_url, "fake", spec, concurrency=streams, vocab_size=1000).output_throughput


def vllm_bench(base_url: str, streams: int, output_len: int, tokenizer: Path, out: Path) -> float | str:
    """The peer's output tok/s, or what went wrong in one line (the ratio is then not printed)."""
    args = ["--backend", "openai", "--base-url", base_url, "--model", "fake", "--tokenizer", str(tokenizer),
            "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", str(output_len),
            "--num-prompts", str(streams), "--max-concurrency", str(streams), "--ignore-eos",
            "--num-warmups", str(streams), "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(out),
            "--result-filename", f"c{streams}.json"]
    done = subprocess.run([sys.executable, "-c", VLLM_BENCH, *args], capture_output=True, text=True)
    saved = out / f"c{streams}.json"
    if done.returncode != 0 or not saved.exists():
        lines = (done.stderr or done.stdout).strip().splitlines()
        return f"vllm bench serve exited {done.returncode}: {lines[-1] if lines else 'no output'}"
    result = json.loads(saved.read_text())
    if not result.get("completed"):
        errors = [e for e in result.get("errors", []) if e]
        return (f"vllm bench serve completed 0 of {streams} requests"
                + (f": {errors[0].strip().splitlines()[-1]}" if errors else ""))
    return result["output_throughput"]


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    total = int(args[0]) if args else 500_000
    plant = "--plant-peer-failure" in sys.argv
    with tempfile.TemporaryDirectory() as tmp, StreamingServer(events_per_write=32) as server:
        peer_url = "http://127.0.0.1:9" if plant else server.base_url  # port 9 (discard): nothing listens
        train_tokenizer(Path(tmp), vocab_size=1000, seed=0)
        print("streams  output_len  ours tok/s  ours+usage tok/s  vllm bench tok/s  ours / vllm bench")
        for streams in STREAMS:
            output_len = min(MAX_OUTPUT_LEN, max(2000, total // streams))
            plain = ours(server.base_url, streams, output_len, continuous_usage=False)
            usage = ours(server.base_url, streams, output_len, continuous_usage=True)
            peer = vllm_bench(peer_url, streams, output_len, Path(tmp), Path(tmp))
            if isinstance(peer, str):
                print(f"{streams:7d}  {output_len:10d}  {plain:10,.0f}  {usage:16,.0f}  {'failed':>16}  {'-':>17}"
                      f"\n         {peer}", flush=True)
                continue
            print(f"{streams:7d}  {output_len:10d}  {plain:10,.0f}  {usage:16,.0f}  {peer:16,.0f}  {plain / peer:17.2f}", flush=True)


if __name__ == "__main__":
    main()

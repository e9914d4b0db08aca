"""How to load the server and how far to sweep: the benchmark's part of every form and CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from tasks.cpus import CpuList


class BenchSpec(BaseModel):
    """How to load the server and how far to sweep; the Prefect UI renders this as a form."""

    api: Literal["completions", "chat"] = Field("completions", description="OpenAI endpoint to stream from")
    concurrency_levels: list[int] = Field([1, 2, 4, 8, 16, 32, 64, 128, 256], min_length=1,
                                          description="Requests in flight per level, swept in order")
    min_throughput_gain: float | None = Field(
        0.05, ge=0, description="Stop when a level adds less than this share of throughput; empty: never")
    level_duration_s: float | None = Field(
        60.0, gt=0, description="Seconds each level keeps sending requests; empty: until requests_per_level are sent")
    requests_per_level: int | None = Field(
        None, ge=1, description="Requests per level (at least its concurrency); empty: as many as level_duration_s "
        "allows. With both, the level ends at the first reached")
    warmup: float = Field(0.1, ge=0, lt=0.5, description="Share of a level's sending time at its start, not measured")
    cooldown: float = Field(0.1, ge=0, lt=0.5, description="Share of a level's sending time at its end, not measured "
                            "(nor is the drain after it)")
    request_rate: float | None = Field(None, gt=0, description="Poisson arrivals per second; empty: all at once")
    burstiness: float = Field(1.0, gt=0, description="Gamma shape of arrivals: 1 Poisson, <1 burstier, >1 steadier")
    input_len: int = Field(1024, ge=1, description="Prompt tokens per request")
    output_len: int = Field(256, ge=2, description="Output tokens per request (ignore_eos makes it exact)")
    dataset: Path | None = Field(None, description="JSONL file of {\"prompt\": text} used instead of random prompts")
    token_id_prompts: bool = Field(True, description="Completions prompts as token ids (exact lengths); off sends "
                                   "text, for servers that take only strings (lengths then from their usage counts)")
    seed: int = Field(0, description="Prompt and arrival seed")
    slo_ttft_ms: float | None = Field(None, gt=0, description="Goodput SLO: time to first token")
    slo_tpot_ms: float | None = Field(None, gt=0, description="Goodput SLO: time per output token")
    slo_e2el_ms: float | None = Field(None, gt=0, description="Goodput SLO: end-to-end latency")
    slo_attainment: float = Field(0.99, gt=0, le=1, description="Share of requests within SLO for a level to pass")
    continuous_usage: bool = Field(True, description="Ask for per-chunk usage (vLLM); off for servers that reject it")
    client_cpus: CpuList | None = Field(None, description="CPUs the benchmark client runs on during a level ('1', "
                                        "'2-3'), apart from the server's on a CPU host. Empty: any")
    max_loop_lag_ms: float = Field(10.0, gt=0, description="Client event-loop lag (p99) above which a level is flagged")
    request_timeout_s: float = Field(600.0, gt=0, description="Deadline per request")

    @field_validator("concurrency_levels")
    @classmethod
    def _positive_levels(cls, levels: list[int]) -> list[int]:
        if any(c < 1 for c in levels):
            raise ValueError("every concurrency level must be >= 1")
        return sorted(set(levels))

    @model_validator(mode="after")
    def _level_has_an_end(self) -> BenchSpec:
        if self.level_duration_s is None and self.requests_per_level is None:
            raise ValueError("a level needs an end: set level_duration_s or requests_per_level")
        return self

    @property
    def load(self) -> str:
        """The load in words, for the lines above a sweep's table."""
        arrivals = (f"{self.request_rate:g} req/s (burstiness {self.burstiness:g}), at most the level's concurrency "
                    "in flight" if self.request_rate else "the level's concurrency in flight")
        ends = [f"{self.level_duration_s:g} s" if self.level_duration_s else "",
                f"{self.requests_per_level} requests" if self.requests_per_level else ""]
        return (f"{self.api}, input {self.input_len}, output {self.output_len} tokens; {arrivals}; levels of "
                + " or ".join(e for e in ends if e)
                + f", the first {self.warmup:.0%} and last {self.cooldown:.0%} not measured")

    @property
    def slos_ms(self) -> dict[str, float]:
        slos = {"ttft": self.slo_ttft_ms, "tpot": self.slo_tpot_ms, "e2el": self.slo_e2el_ms}
        return {k: v for k, v in slos.items() if v is not None}


def geometric_levels(max_concurrency: int, factor: int = 2) -> list[int]:
    """1, factor, factor^2, ... up to max_concurrency, which is always the last level."""
    levels, c = [], 1
    while c < max_concurrency:
        levels.append(c)
        c *= factor
    return levels + [max_concurrency]

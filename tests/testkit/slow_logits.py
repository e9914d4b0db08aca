"""A vLLM logits processor that only waits: a host whose entry loads it (`--logits-processors
testkit.slow_logits:SlowLogits`, with tests/ on PYTHONPATH) answers exactly as the others do, each
token SLOW_S later. The fleet test plants a canary slower on live traffic with it."""

from __future__ import annotations

import time

from vllm.v1.sample.logits_processor import LogitsProcessor

SLOW_S = 0.04


class SlowLogits(LogitsProcessor):
    def __init__(self, vllm_config, device, is_pin_memory) -> None:
        pass

    def apply(self, logits):
        time.sleep(SLOW_S)
        return logits

    def is_argmax_invariant(self) -> bool:
        return False  # else greedy requests skip it

    def update_state(self, batch_update) -> None:
        pass

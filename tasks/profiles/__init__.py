"""What a model family needs from vLLM, kept as data, and the code a model repo would have vLLM run.

`families.py`: the flags a known family is served with (its parsers, its multimodal settings, how
its chat template turns thinking off, the layouts to tune over), so `rollout deploy
moonshotai/Kimi-K2.5` needs no flag that only an expert knows. `remote_code.py`: the Python files a
repo's `auto_map` names, which `--trust-remote-code` executes; never enabled without the operator's
consent, given once per repo and recorded in the host's state.
"""

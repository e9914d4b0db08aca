"""The checkpoint stage: does a checkpoint store what its quantization config says it stores?

headers (safetensors headers, local or by range requests, treated as hostile) -> view (config,
index and headers of one checkpoint, wherever it lives) -> rules (the compressed-tensors checks,
the same verdict before and after download), which read the config through quant_config and
match ignore entries through names.
"""

"""Test and benchmark support that never ships: not installed, not in the worker image.

A hub that misbehaves on request (faulty_hub), an OpenAI-compatible server with set timings
(openai_server) and a Kimi-K2.5-sized sparse checkpoint generator (sparse). The demo's own
serve-only hub and checkpoint builder stay in flows/demo.
"""

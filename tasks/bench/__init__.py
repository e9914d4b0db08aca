"""The benchmark stage: streaming load against an OpenAI-compatible server, measured the way
`vllm bench serve` does, swept over concurrency levels.

spec (what to run) -> prompts -> client (one streamed request, timed) -> load (one level: many
requests, the client watching itself, /metrics from metrics) -> results (a level's typed figures)
-> sweep (levels in order, where to stop, the knee) -> report (table, chart, summary).
"""

"""The serving stage: vLLM's OpenAI server as a child process that can always be found and stopped.

settings (what an operator chooses) -> command (the flags, checked by the installed vLLM's own
parser, from options) -> process (start in its own session, stop the whole group, reap a crashed
run's server) -> readiness (health, the model listed, one real token), log (what vLLM says).
"""

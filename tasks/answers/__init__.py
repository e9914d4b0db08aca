"""The answer check: a deployment that talks nonsense is never promoted."""

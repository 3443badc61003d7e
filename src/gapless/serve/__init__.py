"""Serving the policy over HTTP (an OpenAI-compatible completions API for judges and tools)."""

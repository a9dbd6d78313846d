"""Tokenlane: a latency-aware gateway in front of vLLM replicas."""

__version__ = "0.1.0"

"""Tokenlane: a latency-aware gateway in front of vLLM replicas."""

from proxy import compiled

__version__ = "0.1.0"

# Before any module of the request path is imported: its compiled build, when current.
compiled.install()

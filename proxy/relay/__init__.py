"""The relay and its upstream: one request's attempts, the HTTP client to replicas, SSE."""

"""What the gateway tells operators: metrics, the access log, a request's outcome."""

"""The fleet and its health: replicas, their states, probes, stall detection, discovery."""

"""State shared between gateway instances (Redis) and its local stand-in."""

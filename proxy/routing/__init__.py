"""Routing decisions: classify a request, match a lane, admit it, pick a replica."""

"""Sensors: wait on the delay store's backlog."""

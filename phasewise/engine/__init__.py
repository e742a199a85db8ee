"""Requests, scheduling, the model runner, sampling and the engine loop."""

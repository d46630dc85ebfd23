"""Probes: one config point, one backend, one record. `worker` is the fresh process each runs in."""

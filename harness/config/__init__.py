"""Typed config: the schema, composing it (with the repo's conf/ and sweeps/), validating it."""

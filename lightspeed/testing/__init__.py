"""Test helpers shipped with the package: a gloo process spawner and tiny deterministic models."""

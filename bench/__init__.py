"""Benchmarks: each prints its figures next to a naive baseline measured in the same run."""

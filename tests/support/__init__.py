"""Helpers of the tests: worker classes, entry points, simulated nodes, child processes."""

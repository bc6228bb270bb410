"""The benchmark harness."""

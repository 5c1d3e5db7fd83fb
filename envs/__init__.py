"""The two benchmarks, each an embedded replica plus an adapter to the original environment."""

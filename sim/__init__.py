"""The deterministic simulator and Jepsen-style tests."""

"""The deterministic simulator and Jepsen-style tests (issue 4)."""

"""The broker: topics as chains of ledgers (issue 5)."""

"""Clients of the bookies. Today: the bookie protocol client; the ledger
client (quorum writes, reads, recovery) comes with issue 3."""

from ledger_client.bookie_client import BookieClient, BookieConnectionError

__all__ = ["BookieClient", "BookieConnectionError"]

"""The storage node: wire protocol, journal, ledger storage, the pure request
core and its trio server, identity cookies and registration.

`run_bookie(config)` runs one; `quire bookie run` is its command line."""

from bookie.bookie_process import StartupError, run_bookie
from bookie.config import BookieConfig
from bookie.ledger_storage import LedgerStorage
from bookie.core_actions import CoreLimits
from bookie.request_core import BookieCore
from bookie.server import BookieServer

__all__ = ["BookieConfig", "BookieCore", "BookieServer", "CoreLimits", "LedgerStorage", "StartupError", "run_bookie"]

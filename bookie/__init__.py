"""The storage node: wire protocol, journal, ledger storage, the pure request
core and its trio server, identity cookies and registration.

`run_bookie(config)` runs one; `quire bookie run` is its command line. The
names below are imported on first use, so that a ledger client, which needs
only `bookie.protocol`, does not load the bookie's server and storage.
"""

from __future__ import annotations

from coordination.lazy_exports import lazy_exports
_LAZY = {
    "BookieConfig": "bookie.config",
    "BookieCore": "bookie.request_core",
    "BookieServer": "bookie.server",
    "CoreLimits": "bookie.core_actions",
    "LedgerStorage": "bookie.ledger_storage",
    "StartupError": "bookie.bookie_process",
    "run_bookie": "bookie.bookie_process",
}

__getattr__ = lazy_exports(globals(), _LAZY)

__all__ = ["BookieConfig", "BookieCore", "BookieServer", "CoreLimits", "LedgerStorage", "StartupError", "run_bookie"]

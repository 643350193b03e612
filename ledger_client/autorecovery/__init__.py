"""Auto-recovery of lost replicas (BookKeeper's auditor and replication
workers): one auditor, elected through ZooKeeper, marks the ledgers of
bookies gone longer than a delay; workers copy their fragments to other
bookies and fix the ensembles by compare-and-set. Pure cores
(`audit_core`, `replication_core`), trio drivers (`auditor`,
`replication_worker`, `daemon`), state in ZooKeeper (`underreplication`).
The drivers and the ZooKeeper state are imported on first use, so that
importing a core does not load trio."""

from __future__ import annotations

from coordination.lazy_exports import lazy_exports
from ledger_client.autorecovery.audit_core import AuditCore, ledgers_to_mark
from ledger_client.autorecovery.config import AutoRecoveryConfig
from ledger_client.autorecovery.replication_core import Fragment, Plan, Step, plan_replication

_LAZY = {
    "Auditor": "ledger_client.autorecovery.auditor",
    "AutoRecoveryDaemon": "ledger_client.autorecovery.daemon",
    "Marker": "ledger_client.autorecovery.underreplication",
    "ReplicationError": "ledger_client.autorecovery.replication_worker",
    "ReplicationWorker": "ledger_client.autorecovery.replication_worker",
    "run_autorecovery": "ledger_client.autorecovery.daemon",
}

__getattr__ = lazy_exports(globals(), _LAZY)

__all__ = [
    "AuditCore",
    "Auditor",
    "AutoRecoveryConfig",
    "AutoRecoveryDaemon",
    "Fragment",
    "Marker",
    "Plan",
    "ReplicationError",
    "ReplicationWorker",
    "Step",
    "ledgers_to_mark",
    "plan_replication",
    "run_autorecovery",
]

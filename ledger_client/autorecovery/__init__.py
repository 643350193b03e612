"""Auto-recovery of lost replicas (BookKeeper's auditor and replication
workers): one auditor, elected through ZooKeeper, marks the ledgers of
bookies gone longer than a delay; workers copy their fragments to other
bookies and fix the ensembles by compare-and-set. Pure cores
(`audit_core`, `replication_core`), trio drivers (`auditor`,
`replication_worker`, `daemon`), state in ZooKeeper (`underreplication`)."""

from ledger_client.autorecovery.audit_core import AuditCore, ledgers_to_mark
from ledger_client.autorecovery.auditor import Auditor
from ledger_client.autorecovery.config import AutoRecoveryConfig
from ledger_client.autorecovery.daemon import AutoRecoveryDaemon, run_autorecovery
from ledger_client.autorecovery.replication_core import Fragment, Plan, Step, plan_replication
from ledger_client.autorecovery.replication_worker import ReplicationError, ReplicationWorker
from ledger_client.autorecovery.underreplication import Marker

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

"""The range of every number the command line takes, one named type per kind
of flag. Where the code a number configures has a limit, the bound is that
limit, imported from there; where it has none, the bound is named here with
the reason for it (memory, a 64-bit field, or sense)."""

from __future__ import annotations

import dataclasses

from bookie.config import BookieConfig
from bookie.core_actions import CoreLimits
from bookie.request_core import ID_MAX as ENTRY_ID_MAX
from broker.client.producer import CHUNKED_MESSAGE_BYTES_MAX, MESSAGE_BYTES_MAX  # noqa: F401 (benchmarks bound by it)
from broker.dispatcher import PERMITS_MAX
from broker.protocol import I64_MAX
from broker.topic_records import PARTITIONS_MAX
from coordination.cluster_layout import LEDGER_ID_MAX
# The maxSessionTimeout our ZooKeeper runs with: private to the launcher,
# which writes it into zoo.cfg, and the only place the number lives.
from coordination.zk_launcher import _SESSION_TIMEOUT_MAX_MS as ZOOKEEPER_SESSION_TIMEOUT_MS_MAX
from framing.codec import LENGTH_PREFIX
from ledger_client.autorecovery.config import AutoRecoveryConfig
from ledger_client.ledger_handle import ENTRY_BYTES_MAX
from ledger_client.write_core import ADD_TIMEOUT_MS_DEFAULT
from quire.cli_parsing import INT64_MAX, Bounded, positive_int

KIB, MIB, GIB, PIB = 1024, 1024**2, 1024**3, 1024**5
SECOND_MS = 1000
DAY_MS = 86_400 * SECOND_MS

# --- bounds that the code gives ------------------------------------------------------

FRAME_BYTES_MAX = 2 ** (8 * LENGTH_PREFIX.size) - 1  # a frame's length is a u32 on the wire
FRAME_BYTES_MIN = 64 * KIB  # bookie.config refuses less (a frame must hold a batch of adds)
JOURNAL_FILE_BYTES_MIN = 64 * KIB  # bookie.journal refuses less
ENTRY_LOG_BYTES_MIN = MIB  # bookie.entry_log refuses less
WRITE_CACHE_BYTES_MIN = 64 * KIB  # bookie.config refuses less
# A group commit waiting for more bytes than the journal queue may hold
# never fills: the bookie stops reading its clients first.
GROUP_BYTES_MAX = next(field.default for field in dataclasses.fields(BookieConfig) if field.name == "journal_queue_bytes_max")
# A group commit that waits longer than a ledger client's add timeout fails
# every add it holds.
GROUP_WAIT_MS_MAX = ADD_TIMEOUT_MS_DEFAULT
# simpletest sends every add at once: more than a bookie with the default
# limits takes in flight would be refused with TOO_MANY_REQUESTS.
SIMPLETEST_ENTRIES_MAX = CoreLimits().adds_in_flight_max
JAVA_INT_MAX = 2**31 - 1  # Spark's Dataset.show(n) takes a Java int

# --- bounds of our own, where the code has none ---------------------------------------

MEMORY_BYTES_MAX = 64 * GIB  # a cache or buffer in one process: more than the machines quire runs on hold
FILE_BYTES_MAX = 64 * GIB  # one journal file or entry log (BookKeeper's defaults are 2 GB and 1 GB)
STORAGE_BYTES_MAX = PIB  # what one topic or bookie keeps on disk
PERIOD_MS_MAX = 7 * DAY_MS  # how often a background check runs, or how long a delay is (BookKeeper's longest: the weekly audit)
AGE_MS_MAX = 100 * 365 * DAY_MS  # the age of a ledger or a message (retention, rollover)
# A ledger's metadata, one ZooKeeper node of at most 1 MB, lists every
# ensemble it had (up to the 32 changes the writer allows, plus the first),
# each naming its bookies: 33 ensembles of 1000 ids of ~25 bytes fill it.
ENSEMBLE_SIZE_MAX = 1_000
IN_FLIGHT_MAX = 1_000_000  # a bookie's adds or reads taken and not yet answered
# Each ledger being re-replicated copies up to entries_in_flight_max entries
# at once, each up to an entry's maximum size: more ledgers than this could
# hold more than MEMORY_BYTES_MAX.
REPLICATION_LEDGERS_MAX = MEMORY_BYTES_MAX // (AutoRecoveryConfig().entries_in_flight_max * ENTRY_BYTES_MAX)
LOCAL_PROCESSES_MAX = 256  # processes of one kind a command starts on this machine (each costs ~50 MB)
SEED_MAX = INT64_MAX  # seeds are 64-bit, like everything the traces and histories record
SEEDS_MAX = 1_000_000  # seeds of one `quire sim --seeds` run: weeks of simulation at a few seeds per second
SIMPLETEST_BYTES_MAX = GIB  # simpletest keeps every payload in memory to compare it with what it reads back

# --- the types --------------------------------------------------------------------------

session_timeout_ms = Bounded("integer", 1, ZOOKEEPER_SESSION_TIMEOUT_MS_MAX,
                             why="the longest session our ZooKeeper grants; it would cut a longer one down")
frame_bytes = Bounded("size", FRAME_BYTES_MIN, FRAME_BYTES_MAX, why="a frame's length is a u32")
memory_bytes = Bounded("size", 0, MEMORY_BYTES_MAX, why="more memory than a machine holds")
positive_memory_bytes = Bounded("size", 1, MEMORY_BYTES_MAX, why="more memory than a machine holds")
write_cache_bytes = Bounded("size", WRITE_CACHE_BYTES_MIN, MEMORY_BYTES_MAX, why="more memory than a machine holds")
journal_file_bytes = Bounded("size", JOURNAL_FILE_BYTES_MIN, FILE_BYTES_MAX, why="larger than any one file should be")
entry_log_bytes = Bounded("size", ENTRY_LOG_BYTES_MIN, FILE_BYTES_MAX, why="larger than any one file should be")
group_bytes = Bounded("size", 1, GROUP_BYTES_MAX, why="the journal queue holds no more")
group_wait_ms = Bounded("number", 0, GROUP_WAIT_MS_MAX, why="the ledger client's add timeout")
storage_bytes = Bounded("size", 0, STORAGE_BYTES_MAX, why="more than a disk holds")
positive_storage_bytes = Bounded("size", 1, STORAGE_BYTES_MAX, why="more than a disk holds")
interval_ms = Bounded("integer", 1, PERIOD_MS_MAX, why="a week")
interval = Bounded("duration", 1, PERIOD_MS_MAX, why="a week")
delay = Bounded("duration", 0, PERIOD_MS_MAX, why="a week")
interval_seconds = Bounded("number", 0, PERIOD_MS_MAX / SECOND_MS, why="a week")
age = Bounded("duration", 0, AGE_MS_MAX, why="a century")
positive_age = Bounded("duration", 1, AGE_MS_MAX, why="a century")
in_flight = Bounded("integer", 1, IN_FLIGHT_MAX)
replication_ledgers = Bounded("integer", 1, REPLICATION_LEDGERS_MAX,
                              why="more could hold more entries in memory than a machine has")
ensemble = Bounded("integer", 1, ENSEMBLE_SIZE_MAX, why="a ledger's metadata could not list the ensembles")
partitions = Bounded("integer", 0, PARTITIONS_MAX, why="the broker's limit")
ledger_id = Bounded("integer", 0, LEDGER_ID_MAX, why="ledger ids are signed 64-bit")
entry_id = Bounded("integer", 0, ENTRY_ID_MAX, why="entry ids are signed 64-bit")
entry_count = Bounded("integer", 0, ENTRY_ID_MAX, why="entry ids are signed 64-bit")
entries_per_ledger = Bounded("integer", 1, ENTRY_ID_MAX, why="entry ids are signed 64-bit")
entry_bytes = Bounded("size", 1, ENTRY_BYTES_MAX, why="the largest entry a ledger takes")
message_count = Bounded("integer", 0, I64_MAX, why="offsets and sequence ids are signed 64-bit")
key_count = Bounded("integer", 1, I64_MAX, why="a 64-bit integer")
message_bytes = Bounded("size", 1, CHUNKED_MESSAGE_BYTES_MAX, why="the largest message a producer sends, in chunks past 5 MiB")
window = Bounded("integer", 1, PERMITS_MAX, why="the most messages the broker lets be in flight to a consumer")
simpletest_entries = Bounded("integer", 1, SIMPLETEST_ENTRIES_MAX, why="a bookie's default adds in flight")
simpletest_entry_bytes = Bounded("size", 0, ENTRY_BYTES_MAX, why="the largest entry a ledger takes")
processes = Bounded("integer", 1, LOCAL_PROCESSES_MAX, why="processes on one machine")
processes_or_none = Bounded("integer", 0, LOCAL_PROCESSES_MAX, why="processes on one machine")
jepsen_bookies = Bounded("integer", 4, LOCAL_PROCESSES_MAX, why="processes on one machine")
seconds = Bounded("integer", 1, PERIOD_MS_MAX // SECOND_MS, why="a week")
seed = Bounded("integer", 0, SEED_MAX, why="seeds are 64-bit")
seed_count = Bounded("integer", 1, SEEDS_MAX)
rows = Bounded("integer", 0, JAVA_INT_MAX, why="Spark shows at most a Java int of rows")

# --- the benchmarks' flags (`quire bench NAME ARGS`) -------------------------------------

BENCH_SECONDS_MAX = PERIOD_MS_MAX / SECOND_MS  # a measured run, or a wait for one, of at most a week
BENCH_BOOKIES_MIN = 4  # auto-recovery needs a bookie to re-replicate to once one of an ensemble of 3 is lost
BENCH_MESSAGES_MIN = 100  # broker_memory samples the broker's RSS along the way: fewer messages say nothing
# Ledgers one run creates (ledger_write holds them open at once,
# metrics_overhead writes them in turn, autorecovery and bookie_gc write
# them all first): each is a ZooKeeper node and, open, a handle with its own
# bookie state; the runs measure 1 to 1,000.
BENCH_LEDGERS_MAX = 100_000
# A backlog is written whole and then read (JetStream's run keeps an
# acknowledgement future per message until it is written): at 100,000
# messages a second, some 17 minutes each way.
BENCH_BACKLOG_MESSAGES_MAX = 100_000_000

count = positive_int  # ledgers, rounds, repeats, frames, cycles: how many times something is done
bench_seconds = Bounded("number", 0, BENCH_SECONDS_MAX, low_open=True, why="a week")
warmup_seconds = Bounded("number", 0, BENCH_SECONDS_MAX, why="a week")
bench_bookies = Bounded("integer", BENCH_BOOKIES_MIN, LOCAL_PROCESSES_MAX, why="processes on one machine")
bench_messages = Bounded("integer", BENCH_MESSAGES_MIN, I64_MAX, why="offsets and sequence ids are signed 64-bit")
bench_ledgers = Bounded("integer", 1, BENCH_LEDGERS_MAX, why="ledgers one benchmark creates and holds: ZooKeeper nodes and handles")
bench_backlog = Bounded("integer", 1, BENCH_BACKLOG_MESSAGES_MAX, why="a backlog written and read within hours")
compaction_threshold = Bounded("number", 0, 1)

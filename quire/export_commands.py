"""`quire export TOPIC --out DIR`: a Spark job that writes a topic's closed
ledgers (read straight from the bookies by the `quire` data source) as
Parquet or JSON. ZooKeeper is read, the ledgers checked and a local output
directory prepared before Spark starts, so that a mistake is one line at
once. `--incremental` adds only the ledgers that closed since the last run,
under an exclusive lock on DIR: each run is written under `DIR/_pending-<n>`,
its manifest (the ledgers it holds) is written into it once Spark committed,
and a rename to `DIR/run=<n>` commits the run. A pending directory left by a
crash is committed by the next run when its manifest is there, else deleted
and written again: nothing is written twice.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import re
import shutil
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from quire import cli_ranges as ranges
from quire.cli_parsing import INT64_MAX, Bounded, UsageError

MANIFEST = "_quire_manifest.json"
RUN_PREFIX = "run="
PENDING_PREFIX = "_pending-"
LOCK = "_lock"  # held (flock) by the incremental run writing to the directory
PROGRESS_POLL_S = 0.5
EXIT_FAILED = 1  # the job failed at run time (not the operator's input)


class ExportFailed(Exception):
    """The Spark job failed; the message is the one line to print."""


def _time_ms(text: str) -> int:
    from broker.export_plan import parse_time_ms

    try:
        return parse_time_ms(text, "a time")
    except (ValueError, OverflowError) as error:  # OverflowError: an ISO time past what a timestamp holds
        raise argparse.ArgumentTypeError(str(error)) from None


# A time, given as ms since the epoch or ISO 8601, from the epoch on.
time_ms = Bounded("time", 0, INT64_MAX, why="a 64-bit count of milliseconds", parse=_time_ms)


def spark_setting(text: str) -> tuple[str, str]:
    key, equals, value = text.partition("=")
    if not equals or not key.strip():
        raise argparse.ArgumentTypeError(f"a Spark setting is KEY=VALUE, got {text!r}")
    return key.strip(), value


def add_export(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("topic", help="topic to export (every partition of a partitioned topic)")
    from quire.security_options import add_credentials

    # The executors show the token to bookies that authenticate their
    # clients, and trust the CA's certificates (sent as text) where bookies
    # serve TLS. A client certificate is not shipped: use a token.
    add_credentials(parser)
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory (a path or a Hadoop URI)")
    parser.add_argument("--format", default="parquet", choices=["parquet", "json"], help="output format")
    parser.add_argument("--incremental", action="store_true",
                        help="write only ledgers closed since the last incremental run into DIR (one run=<n> folder per run)")
    parser.add_argument("--overwrite", action="store_true", help="without --incremental: replace DIR if it exists")
    parser.add_argument("--compacted", action="store_true",
                        help="export the topic's compacted view (the latest message of each key as of its last compaction) "
                             "instead of its closed ledgers")
    parser.add_argument("--master", default="local[2]", help="Spark master (default %(default)s)")
    parser.add_argument("--conf", action="append", type=spark_setting, default=[], metavar="KEY=VALUE",
                        help="a Spark setting (repeat the flag for more), e.g. spark.executor.memory=4g")
    parser.add_argument("--no-ship", action="store_true",
                        help="with a cluster master: do not ship quire's environment to the executors (they have quire)")
    parser.add_argument("--password", default="", help="the brokers' --ledger-password")
    parser.add_argument("--from-ledger", type=ranges.ledger_id, metavar="ID", help="only ledgers from this id on")
    parser.add_argument("--start-time", type=time_ms, metavar="TIME", help="only entries the brokers appended at or after TIME (ms or ISO 8601)")
    parser.add_argument("--end-time", type=time_ms, metavar="TIME", help="only entries appended before TIME")
    parser.add_argument("--split-bytes", type=ranges.positive_storage_bytes, default=None, metavar="SIZE",
                        help="cut ledgers larger than this into several input partitions (default 128MiB)")
    parser.add_argument("--show", type=ranges.rows, default=0, metavar="N",
                        help="afterwards, read DIR back with Spark and print N rows")


# --- the output directory -------------------------------------------------------------------


def local_path(out: str, master: str) -> Path | None:
    """The local directory `out` names, or None for a Hadoop URI (and for a
    bare path under a real cluster, whose default file system decides)."""
    if out.startswith("file:"):
        return Path(urllib.parse.urlparse(out).path)
    if re.match(r"^[A-Za-z][\w+.-]*://", out):
        return None
    return Path(out) if master.startswith("local") else None


@dataclass
class LocalDirectory:
    """The output directory on this machine: checked and prepared before
    Spark starts; the manifest is fsynced, and its directory, before the
    commit rename."""

    path: Path

    @property
    def uri(self) -> str:
        # Not Path.as_uri(): it would escape the "=" of run=<n>.
        return f"file:{self.path.absolute()}"

    def child(self, name: str) -> str:
        return f"file:{(self.path / name).absolute()}"

    def exists(self, name: str | None = None) -> bool:
        return (self.path if name is None else self.path / name).exists()

    def names(self) -> list[str]:
        return sorted(os.listdir(self.path)) if self.path.is_dir() else []

    def folders(self) -> list[str]:
        return [name for name in self.names() if (self.path / name).is_dir()]

    def delete(self, name: str) -> None:
        shutil.rmtree(self.path / name, ignore_errors=True)

    def rename(self, source: str, target: str) -> None:
        from bookie.durable_files import fsync_directory

        os.rename(self.path / source, self.path / target)
        fsync_directory(self.path)

    def read(self, name: str) -> bytes:
        return (self.path / name).read_bytes()

    def write_durably(self, name: str, data: bytes) -> None:
        """Write, fsync, rename into place, fsync the directory."""
        from bookie.durable_files import write_file_atomically

        write_file_atomically(self.path / name, data)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            handle = open(self.path / LOCK, "a")
        except OSError as error:
            raise UsageError(f"cannot write to {self.path}: {error.strerror}") from None
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise UsageError(f"another export is writing to {self.path}") from None
            yield  # the lock goes with the file's close


@dataclass
class HadoopDirectory:
    """The output directory through Hadoop's FileSystem (a real cluster's
    HDFS or object store), reached once Spark has started."""

    spark: Any
    uri: str

    def __post_init__(self) -> None:
        jvm = self.spark._jvm
        self._Path = jvm.org.apache.hadoop.fs.Path
        self.path = self._Path(self.uri)
        self.file_system = self.path.getFileSystem(self.spark._jsc.hadoopConfiguration())
        if self.file_system.getScheme() == "file" and not self.path.isAbsolute():
            # The local file system would take it relative to the JVM's
            # working directory, which is not the caller's.
            self.uri = f"file:{os.path.abspath(self.uri)}"
            self.path = self._Path(self.uri)
        self._jvm = jvm

    def child(self, name: str) -> str:
        return self._Path(self.path, name).toString()

    def exists(self, name: str | None = None) -> bool:
        return bool(self.file_system.exists(self.path if name is None else self._Path(self.path, name)))

    def names(self) -> list[str]:
        if not self.exists():
            return []
        return sorted(status.getPath().getName() for status in self.file_system.listStatus(self.path))

    def folders(self) -> list[str]:
        if not self.exists():
            return []
        return sorted(status.getPath().getName() for status in self.file_system.listStatus(self.path) if status.isDirectory())

    def delete(self, name: str) -> None:
        self.file_system.delete(self._Path(self.path, name), True)

    def rename(self, source: str, target: str) -> None:
        if not self.file_system.rename(self._Path(self.path, source), self._Path(self.path, target)):
            raise RuntimeError(f"could not rename {self.child(source)} to {self.child(target)}")

    def read(self, name: str) -> bytes:
        stream = self.file_system.open(self._Path(self.path, name))
        try:
            return bytes(self._jvm.org.apache.commons.io.IOUtils.toByteArray(stream))
        finally:
            stream.close()

    def write_durably(self, name: str, data: bytes) -> None:
        """Write a file under a temporary name, hsync it, rename it into place."""
        temporary = f"{name}.tmp"
        stream = self.file_system.create(self._Path(self.path, temporary), True)
        try:
            stream.write(bytearray(data))
            stream.hsync()
        finally:
            stream.close()
        if self.exists(name):
            self.delete(name)
        self.rename(temporary, name)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """A lock file created exclusively (Hadoop has no flock): a run that
        died holding it leaves it behind, and the message says so."""
        from py4j.protocol import Py4JJavaError

        lock_path = self._Path(self.path, LOCK)
        try:
            self.file_system.create(lock_path, False).close()
        except Py4JJavaError:
            raise UsageError(f"another export is writing to {self.uri} (if none is, one that died left "
                             f"{self.child(LOCK)}: delete it)") from None
        try:
            yield
        finally:
            self.file_system.delete(lock_path, False)


def run_number(folder: str) -> int | None:
    for prefix in (RUN_PREFIX, PENDING_PREFIX):
        if folder.startswith(prefix) and folder[len(prefix):].isdigit():
            return int(folder[len(prefix):])
    return None


def read_manifest(output: LocalDirectory | HadoopDirectory, folder: str) -> dict:
    """A run's manifest; ValueError says why it cannot be read."""
    try:
        manifest = json.loads(output.read(f"{folder}/{MANIFEST}"))
        if not isinstance(manifest, dict) or manifest.get("run") != run_number(folder):
            raise ValueError("it is not the manifest of this run")
        [int(ledger["ledger_id"]) for ledger in manifest["ledgers"]]
        manifest["topic"], manifest["format"]
        return manifest
    except Exception as error:  # missing, unreadable, not JSON, wrong shape: all the same here
        raise ValueError(f"{type(error).__name__}: {error}") from None


def committed_runs(output: LocalDirectory | HadoopDirectory) -> list[dict]:
    """The manifests of the committed runs (run=<n> folders), oldest first."""
    manifests = []
    for folder in output.folders():
        if folder.startswith(RUN_PREFIX) and run_number(folder) is not None:
            try:
                manifests.append(read_manifest(output, folder))
            except ValueError as error:
                raise UsageError(f"the manifest of the committed run {output.child(folder)} cannot be read ({error}); "
                                 f"move that run away to export its ledgers again") from None
    return sorted(manifests, key=lambda manifest: manifest["run"])


def prepare_incremental(output: LocalDirectory | HadoopDirectory, arguments: argparse.Namespace) -> tuple[int, list[dict]]:
    """Under the lock: finish or discard the runs that died before their
    commit, check DIR holds this topic's incremental export; returns the
    next run's number and the committed runs' manifests."""
    numbered = [name for name in output.names() if run_number(name) is not None]
    if not numbered and [name for name in output.names() if name != LOCK]:
        raise UsageError(f"{arguments.out} is not empty and holds no {RUN_PREFIX}<n> runs: --incremental needs "
                         f"a directory of its own (a new one, or one an incremental export wrote)")
    for folder in output.folders():
        if folder.startswith(PENDING_PREFIX) and run_number(folder) is not None:
            try:  # Spark committed it and its manifest was written: only the rename was missing
                read_manifest(output, folder)
                output.rename(folder, f"{RUN_PREFIX}{run_number(folder)}")
            except ValueError:  # died before its manifest: its ledgers were never recorded
                output.delete(folder)
    runs = committed_runs(output)
    for manifest in runs:
        if manifest["format"] != arguments.format or manifest["topic"] != arguments.topic:
            raise UsageError(f"{arguments.out} holds an incremental export of {manifest['topic']!r} as "
                             f"{manifest['format']}; export {arguments.topic!r} as {arguments.format} elsewhere")
    run = max((run_number(folder) or 0 for folder in output.folders()), default=0) + 1
    return run, runs


class StageProgress:
    """A progress bar of ledgers done, fed from Spark's status tracker (the
    tasks of the job group done, out of the input partitions)."""

    def __init__(self, spark: Any, group: str, ledgers: int, splits: int) -> None:
        from quire.progress import Progress

        self.tracker = spark.sparkContext.statusTracker()
        self.group = group
        self.ledgers = ledgers
        self.splits = splits
        self.bar = Progress("export (ledgers)", total=ledgers, unit="ledgers")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, name="export-progress", daemon=True)

    def _tasks_done(self) -> int:
        done = 0
        for job_id in self.tracker.getJobIdsForGroup(self.group):
            job = self.tracker.getJobInfo(job_id)
            for stage_id in job.stageIds if job else ():
                stage = self.tracker.getStageInfo(stage_id)
                if stage is not None:
                    done = max(done, stage.numCompletedTasks)
        return done

    def _poll(self) -> None:
        while not self.stop.wait(PROGRESS_POLL_S):
            self.bar.update(self.ledgers * min(1.0, self._tasks_done() / self.splits))

    def __enter__(self) -> "StageProgress":
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        self.thread.join()
        self.bar.__exit__()


class LazySession:
    """The command's Spark session, started the first time it is needed:
    an export with nothing to write never starts Spark. With a cluster
    master, quire's environment is shipped to the executors
    (quire.spark_shipping) unless --no-ship."""

    def __init__(self, arguments: argparse.Namespace) -> None:
        self.arguments = arguments
        self.session: Any = None
        self._stop: Callable[[], None] | None = None

    def __call__(self) -> Any:
        from quire.spark_shipping import start_session

        if self.session is None:
            # --log-level debug keeps Spark's own log, for finding out more.
            self.session, self._stop = start_session(
                self.arguments.master, f"quire export {self.arguments.topic}",
                dict(getattr(self.arguments, "conf", None) or ()), ship=not getattr(self.arguments, "no_ship", False),
                quiet=self.arguments.log_level != "debug")
        return self.session

    def stop(self) -> None:
        if self._stop is not None:
            self._stop()


def export(arguments: argparse.Namespace) -> int:
    from quire.extras import require

    require("spark", "quire export")
    check_arguments(arguments)
    spark = LazySession(arguments)
    try:
        result = run_export(spark, arguments)
        if arguments.show:
            if result["readable"]:
                show(spark(), result["out"], arguments.format, arguments.show)
            else:
                print(f"nothing exported to {arguments.out}: nothing to show")
    except ExportFailed as error:
        print(f"quire export: error: {error}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        spark.stop()
    return 0


def executor_credentials(arguments: argparse.Namespace) -> dict[str, str]:
    """The data source's options that carry the command's credentials."""
    from quire.security_options import auth_token_from

    from coordination.zk_store import digest_auth

    options = {}
    if digest_auth() is not None:
        options["zk_auth_password"] = digest_auth()  # named so that Spark redacts it
    token = auth_token_from(arguments)
    if callable(token):
        token = token()
    if token:
        options["auth_token"] = token
    trust = getattr(arguments, "tls_trust_certs_file", None)
    if trust is not None:
        try:
            with open(trust) as file:
                options["tls_trust_certs"] = file.read()
        except OSError as error:
            raise UsageError(f"--tls-trust-certs-file: cannot read {trust}: {error.strerror}") from None
    return options


def check_arguments(arguments: argparse.Namespace) -> None:
    from broker.export_plan import Selection, parse_time_ms
    from broker.topic_records import check_name

    try:
        check_name(arguments.topic)
        selection = Selection(from_ledger=arguments.from_ledger,
                              start_time_ms=parse_time_ms(arguments.start_time, "--start-time"),
                              end_time_ms=parse_time_ms(arguments.end_time, "--end-time"))
    except ValueError as error:
        raise UsageError(str(error)) from None
    if getattr(arguments, "tls_cert_file", None) is not None:
        raise UsageError("quire export does not ship a client certificate to Spark's executors: authenticate with "
                         "--auth-token (with --tls-trust-certs-file for bookies that serve TLS)")
    executor_credentials(arguments)  # a file that cannot be read is said now
    if arguments.incremental and (selection.start_time_ms is not None or selection.end_time_ms is not None):
        raise UsageError("--incremental records whole ledgers: it cannot be combined with --start-time/--end-time")
    if arguments.incremental and arguments.overwrite:
        raise UsageError("--overwrite replaces what --incremental keeps; use one or the other")
    if arguments.compacted and (arguments.incremental or arguments.from_ledger is not None
                                or selection.start_time_ms is not None or selection.end_time_ms is not None):
        raise UsageError("--compacted exports the compacted view whole: it cannot be combined with --incremental, "
                         "--from-ledger, --start-time or --end-time")
    arguments.selection = selection


def read_plan(arguments: argparse.Namespace) -> list:
    """The topic's chains of ledgers from ZooKeeper, with every ledger the
    selection takes checked (exists, opens with --password, closed): an
    operator's mistake is one line here, before Spark starts."""
    from broker.export_plan import SPLIT_BYTES_DEFAULT, plan_splits
    from broker.spark_source import ClusterMetadata, LedgerDeletedError
    from coordination.store import MetadataError

    try:
        with ClusterMetadata(arguments.zk, arguments.root) as cluster:
            chains = cluster.chains(arguments.topic, arguments.compacted)
            splits = plan_splits(chains, arguments.selection, arguments.split_bytes or SPLIT_BYTES_DEFAULT)
            cluster.check_ledgers(splits, arguments.password.encode())
    except LedgerDeletedError as error:
        raise ExportFailed(str(error)) from None
    except (MetadataError, ValueError) as error:
        raise UsageError(str(error)) from None
    return chains


def run_export(spark: Any, arguments: argparse.Namespace) -> dict:
    """Export with `spark` (a session, or a function that starts one when
    it is needed); returns what was written: the ledgers, the input
    partitions, the run (incremental), the rows, and where."""
    from broker.export_plan import SPLIT_BYTES_DEFAULT, plan_splits

    session: Callable[[], Any] = spark if callable(spark) else (lambda: spark)
    if not hasattr(arguments, "selection"):
        check_arguments(arguments)
    split_bytes = arguments.split_bytes or SPLIT_BYTES_DEFAULT
    chains = read_plan(arguments)
    result = {"ledgers": [], "splits": 0, "run": None, "messages": 0, "out": arguments.out, "readable": False}
    with contextlib.ExitStack() as stack:
        path = local_path(arguments.out, arguments.master)
        output = LocalDirectory(path) if path is not None else HadoopDirectory(session(), arguments.out)
        result["out"] = output.uri
        selection, run, runs = arguments.selection, None, []
        if arguments.incremental:
            stack.enter_context(output.lock())
            run, runs = prepare_incremental(output, arguments)
            written = frozenset(ledger["ledger_id"] for manifest in runs for ledger in manifest["ledgers"])
            selection = dataclasses.replace(selection, exclude_ledger_ids=written)
        elif not arguments.overwrite and output.names():
            raise UsageError(f"{arguments.out} exists and is not empty (--overwrite replaces it, --incremental adds to it)")
        result["readable"] = any(manifest.get("messages", 1) for manifest in runs)
        splits = plan_splits(chains, selection, split_bytes)
        if not splits:
            what = "compacted view (compact it first: quire topic compact)" if arguments.compacted else \
                f"{'new ' if arguments.incremental else ''}closed ledgers"
            print(f"nothing to export: topic {arguments.topic} has no {what}")
            return result
        ledgers = {}
        for split in splits:
            ledgers.setdefault(split.ledger_id, split)
        started = session()  # its start-up is not the export's time
        began = time.monotonic()
        folder = f"{PENDING_PREFIX}{run}" if run is not None else None
        target = output.child(folder) if folder is not None else output.uri
        # The directory exists only if it is empty (or --overwrite): Spark's
        # "errorifexists" would refuse an empty one.
        mode = "overwrite" if arguments.overwrite or (run is None and output.exists()) else "errorifexists"
        try:
            messages = write(started, arguments, selection, split_bytes, sorted(ledgers), len(splits), mode, target)
        except ExportFailed:
            if folder is not None:
                output.delete(folder)  # nothing of it was recorded: the next run writes its ledgers
            raise
        if run is not None:
            manifest = {
                "run": run, "topic": arguments.topic, "format": arguments.format, "written_ms": int(time.time() * 1000),
                "messages": messages,
                "ledgers": [{"partition": split.partition, "ledger_id": split.ledger_id, "entries": split.ledger_entries,
                             "first_offset": split.ledger_first_offset} for split in ledgers.values()],
            }
            output.write_durably(f"{folder}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
            output.rename(folder, f"{RUN_PREFIX}{run}")  # the commit
        elapsed_s = time.monotonic() - began
        size = sum(split.bytes for split in splits)
        where = output.child(f"{RUN_PREFIX}{run}") if run is not None else output.uri
        print(f"exported {len(ledgers)} ledgers ({len(splits)} input partitions, {messages} messages, "
              f"{size / 1e6:.1f} MB stored) of {arguments.topic} to {where} in {elapsed_s:.1f}s")
        result.update(ledgers=sorted(ledgers), splits=len(splits), run=run, messages=messages,
                      readable=result["readable"] or messages > 0)
        return result


def write(spark: Any, arguments: argparse.Namespace, selection: Any, split_bytes: int, ledger_ids: list[int],
          splits: int, mode: str, target: str) -> int:
    """Run the Spark job that writes `ledger_ids` to `target`; returns the
    rows written, counted from the output (a time range leaves out some of
    a ledger's messages). A failed job is one line: ExportFailed."""
    from py4j.protocol import Py4JJavaError
    from pyspark.errors import PySparkException

    from broker.spark_source import NAME, SCHEMA

    reader = (spark.read.format(NAME).option("zk", arguments.zk).option("root", arguments.root)
              .option("topic", arguments.topic).option("password", arguments.password)
              .option("split_bytes", str(split_bytes))
              .option("ledgers", ",".join(map(str, ledger_ids)))
              .option("compacted", "true" if arguments.compacted else "false"))
    # Spark redacts options named like a token in its plans and UI.
    for name, value in executor_credentials(arguments).items():
        reader = reader.option(name, value)
    for name, value in (("start_time", selection.start_time_ms), ("end_time", selection.end_time_ms)):
        if value is not None:
            reader = reader.option(name, str(value))
    group = f"quire-export-{time.time_ns()}"
    spark.sparkContext.setJobGroup(group, f"quire export {arguments.topic}")
    try:
        with StageProgress(spark, group, len(ledger_ids), splits):
            reader.load().write.mode(mode).format(arguments.format).save(target)
        # Parquet counts from its footers; JSON is read again.
        return spark.read.schema(SCHEMA).format(arguments.format).load(target).count()
    except (PySparkException, Py4JJavaError) as error:
        raise ExportFailed(diagnose(error, arguments, ledger_ids)) from None


def diagnose(error: BaseException, arguments: argparse.Namespace, ledger_ids: list[int]) -> str:
    """One line for a failed job: a planned ledger that retention deleted
    meanwhile, else the root cause Spark reports."""
    from broker.spark_source import ClusterMetadata
    from coordination.store import MetadataError

    try:
        with ClusterMetadata(arguments.zk, arguments.root) as cluster:
            present = {info.ledger_id for chain in cluster.chains(arguments.topic, arguments.compacted) for info in chain.ledgers}
            gone = sorted(set(ledger_ids) - present | set(cluster.missing_ledgers(ledger_ids)))
    except (MetadataError, ValueError):
        gone = []
    if gone:
        return f"ledger {gone[0]} was deleted by retention during the export; run it again"
    cause = root_cause(error)
    if getattr(arguments, "no_ship", False) and re.search(MISSING_PYTHON, cause):
        cause += (" (with --no-ship the Python that Spark runs, on the executors and on this machine, "
                  "must have quire installed; leave out --no-ship to ship quire's environment)")
    return f"the Spark job failed: {cause}"


# What a Python without quire's packages (or none at all) makes a job fail with.
MISSING_PYTHON = re.compile(r"^(ModuleNotFoundError|ImportError): |^IOException: Cannot run program|PYTHON_VERSION_MISMATCH")
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)): ?(.*)$")


def root_cause(error: BaseException) -> str:
    """The last exception a (Python worker's) traceback in `error`'s message
    names, as `Name: message`; else the message's first line."""
    lines = str(error).splitlines()
    for line in reversed(lines):
        match = _EXCEPTION_LINE.match(line.strip())
        if match and not line.startswith(" "):
            return f"{match.group(1)}: {match.group(2)}".rstrip(": ")
    return next((line.strip() for line in lines if line.strip()), type(error).__name__)


def show(spark: Any, directory: str, format_: str, rows: int) -> None:
    """Read an export back with Spark and print a few rows and the count."""
    from pyspark.sql import functions

    frame = spark.read.format(format_).load(directory)
    frame = frame.withColumn("payload", functions.substring(functions.col("payload").cast("string"), 1, 24))
    print(f"{frame.count()} rows in {directory}; the first {rows} by partition and offset:")
    frame.orderBy("partition", "offset").show(rows, truncate=False)

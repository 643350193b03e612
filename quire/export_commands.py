"""`quire export TOPIC --out DIR`: a Spark job that writes a topic's closed
ledgers (read straight from the bookies by the `quire` data source) as
Parquet or JSON. `--incremental` adds only the ledgers that closed since the
last run: each run is written under `DIR/_pending-<n>`, its manifest (the
ledgers it holds) is written into it once Spark committed, and a rename to
`DIR/run=<n>` commits the run. A crash before the rename leaves a pending
directory that the next run deletes and writes again; nothing is written twice.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

from quire.cli import UsageError, byte_size, nonnegative_int

MANIFEST = "_quire_manifest.json"
RUN_PREFIX = "run="
PENDING_PREFIX = "_pending-"
PROGRESS_POLL_S = 0.5


def add_export(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("topic", help="topic to export (every partition of a partitioned topic)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory (a path or a Hadoop URI)")
    parser.add_argument("--format", default="parquet", choices=["parquet", "json"])
    parser.add_argument("--incremental", action="store_true",
                        help="write only ledgers closed since the last incremental run into DIR (one run=<n> folder per run)")
    parser.add_argument("--overwrite", action="store_true", help="without --incremental: replace DIR if it exists")
    parser.add_argument("--master", default="local[2]", help="Spark master (default %(default)s)")
    parser.add_argument("--password", default="", help="the brokers' --ledger-password")
    parser.add_argument("--from-ledger", type=nonnegative_int, metavar="ID", help="only ledgers from this id on")
    parser.add_argument("--start-time", metavar="TIME", help="only entries the brokers appended at or after TIME (ms or ISO 8601)")
    parser.add_argument("--end-time", metavar="TIME", help="only entries appended before TIME")
    parser.add_argument("--split-bytes", type=byte_size, default=None, metavar="SIZE",
                        help="cut ledgers larger than this into several input partitions (default 128MiB)")
    parser.add_argument("--show", type=nonnegative_int, default=0, metavar="N",
                        help="afterwards, read DIR back with Spark and print N rows")


@dataclass
class OutputDirectory:
    """The output directory through Hadoop's FileSystem (so that a real
    cluster's HDFS works as a local path does): listing, renames, manifests."""

    spark: Any
    uri: str

    def __post_init__(self) -> None:
        jvm = self.spark._jvm
        self._Path = jvm.org.apache.hadoop.fs.Path
        self.path = self._Path(self.uri)
        self.fs = self.path.getFileSystem(self.spark._jsc.hadoopConfiguration())
        self._jvm = jvm

    def child(self, name: str) -> str:
        return self._Path(self.path, name).toString()

    def exists(self, name: str | None = None) -> bool:
        return bool(self.fs.exists(self.path if name is None else self._Path(self.path, name)))

    def is_empty(self) -> bool:
        return not self.exists() or len(self.fs.listStatus(self.path)) == 0

    def folders(self) -> list[str]:
        if not self.exists():
            return []
        return sorted(status.getPath().getName() for status in self.fs.listStatus(self.path) if status.isDirectory())

    def delete(self, name: str) -> None:
        self.fs.delete(self._Path(self.path, name), True)

    def rename(self, source: str, target: str) -> None:
        if not self.fs.rename(self._Path(self.path, source), self._Path(self.path, target)):
            raise RuntimeError(f"could not rename {self.child(source)} to {self.child(target)}")

    def read(self, name: str) -> bytes:
        stream = self.fs.open(self._Path(self.path, name))
        try:
            return bytes(self._jvm.org.apache.commons.io.IOUtils.toByteArray(stream))
        finally:
            stream.close()

    def write_atomically(self, name: str, data: bytes) -> None:
        """Write a file under a temporary name, then rename it into place."""
        temporary = f"{name}.tmp"
        stream = self.fs.create(self._Path(self.path, temporary), True)
        try:
            stream.write(bytearray(data))
        finally:
            stream.close()
        if self.exists(name):
            self.delete(name)
        self.rename(temporary, name)


def run_number(folder: str) -> int | None:
    for prefix in (RUN_PREFIX, PENDING_PREFIX):
        if folder.startswith(prefix) and folder[len(prefix):].isdigit():
            return int(folder[len(prefix):])
    return None


def committed_runs(output: OutputDirectory) -> list[dict]:
    """The manifests of the committed runs (run=<n> folders), oldest first."""
    manifests = []
    for folder in output.folders():
        if folder.startswith(RUN_PREFIX) and run_number(folder) is not None:
            manifests.append(json.loads(output.read(f"{folder}/{MANIFEST}")))
    return sorted(manifests, key=lambda manifest: manifest["run"])


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


def export(arguments: argparse.Namespace) -> int:
    from broker.spark_source import spark_session

    check_arguments(arguments)
    spark = spark_session(arguments.master, f"quire export {arguments.topic}")
    try:
        run_export(spark, arguments)
        if arguments.show:
            show(spark, arguments.out, arguments.format, arguments.show)
    finally:
        spark.stop()
    return 0


def check_arguments(arguments: argparse.Namespace) -> None:
    from broker.export_plan import Selection, parse_time_ms
    from broker.topic_store import check_name

    try:
        check_name(arguments.topic)
        selection = Selection(from_ledger=arguments.from_ledger,
                              start_time_ms=parse_time_ms(arguments.start_time, "--start-time"),
                              end_time_ms=parse_time_ms(arguments.end_time, "--end-time"))
    except ValueError as error:
        raise UsageError(str(error)) from None
    if arguments.incremental and (selection.start_time_ms is not None or selection.end_time_ms is not None):
        raise UsageError("--incremental records whole ledgers: it cannot be combined with --start-time/--end-time")
    if arguments.incremental and arguments.overwrite:
        raise UsageError("--overwrite replaces what --incremental keeps; use one or the other")
    arguments.selection = selection


def run_export(spark: Any, arguments: argparse.Namespace) -> dict:
    """Export with `spark`; returns what was written: the ledgers, the
    input partitions, the run (incremental) and where."""
    from broker.export_plan import SPLIT_BYTES_DEFAULT, Selection, plan_splits
    from broker.spark_source import NAME, read_topic_ledgers

    if not hasattr(arguments, "selection"):
        check_arguments(arguments)
    selection = arguments.selection
    split_bytes = arguments.split_bytes or SPLIT_BYTES_DEFAULT
    try:
        chains = read_topic_ledgers(arguments.zk, arguments.root, arguments.topic)
    except ValueError as error:
        raise UsageError(str(error)) from None

    output = OutputDirectory(spark, arguments.out)
    run, target = None, arguments.out
    if arguments.incremental:
        runs = committed_runs(output)
        for manifest in runs:
            if manifest["format"] != arguments.format or manifest["topic"] != arguments.topic:
                raise UsageError(f"{arguments.out} holds an incremental export of {manifest['topic']!r} as "
                                 f"{manifest['format']}; export {arguments.topic!r} as {arguments.format} elsewhere")
        for folder in output.folders():  # runs that crashed before their commit
            if folder.startswith(PENDING_PREFIX):
                output.delete(folder)
        written = frozenset(ledger["ledger_id"] for manifest in runs for ledger in manifest["ledgers"])
        selection = Selection(from_ledger=selection.from_ledger, exclude_ledger_ids=written)
        run = max((run_number(folder) or 0 for folder in output.folders()), default=0) + 1
        target = output.child(f"{PENDING_PREFIX}{run}")
    elif not arguments.overwrite and not output.is_empty():
        raise UsageError(f"{arguments.out} exists and is not empty (--overwrite replaces it, --incremental adds to it)")

    splits = plan_splits(chains, selection, split_bytes)
    ledgers = {}
    for split in splits:
        ledgers.setdefault(split.ledger_id, split)
    began = time.monotonic()
    if not splits:
        print(f"nothing to export: topic {arguments.topic} has no {'new ' if arguments.incremental else ''}closed ledgers")
    else:
        reader = (spark.read.format(NAME).option("zk", arguments.zk).option("root", arguments.root)
                  .option("topic", arguments.topic).option("password", arguments.password)
                  .option("split_bytes", str(split_bytes))
                  .option("ledgers", ",".join(str(ledger_id) for ledger_id in sorted(ledgers))))
        for name, value in (("start_time", selection.start_time_ms), ("end_time", selection.end_time_ms)):
            if value is not None:
                reader = reader.option(name, str(value))
        group = f"quire-export-{time.time_ns()}"
        spark.sparkContext.setJobGroup(group, f"quire export {arguments.topic}")
        with StageProgress(spark, group, len(ledgers), len(splits)):
            reader.load().write.mode("overwrite" if arguments.overwrite else "errorifexists").format(arguments.format).save(target)
        if run is not None:
            manifest = {
                "run": run, "topic": arguments.topic, "format": arguments.format, "written_ms": int(time.time() * 1000),
                "ledgers": [{"partition": split.partition, "ledger_id": split.ledger_id, "entries": split.ledger_entries,
                             "first_offset": split.ledger_first_offset} for split in ledgers.values()],
            }
            output.write_atomically(f"{PENDING_PREFIX}{run}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
            output.rename(f"{PENDING_PREFIX}{run}", f"{RUN_PREFIX}{run}")  # the commit
        elapsed_s = time.monotonic() - began
        messages = sum(info.messages or 0 for chain in chains for info in chain.ledgers if info.ledger_id in ledgers)
        size = sum(split.bytes for split in splits)
        where = output.child(f"{RUN_PREFIX}{run}") if run is not None else arguments.out
        print(f"exported {len(ledgers)} ledgers ({len(splits)} input partitions, {messages} messages, "
              f"{size / 1e6:.1f} MB stored) of {arguments.topic} to {where} in {elapsed_s:.1f}s")
    return {"ledgers": sorted(ledgers), "splits": len(splits), "run": run if splits else None}


def show(spark: Any, directory: str, format_: str, rows: int) -> None:
    """Read an export back with Spark and print a few rows and the count."""
    from pyspark.sql import functions

    frame = spark.read.format(format_).load(directory)
    frame = frame.withColumn("payload", functions.substring(functions.col("payload").cast("string"), 1, 24))
    print(f"{frame.count()} rows in {directory}; the first {rows} by partition and offset:")
    frame.orderBy("partition", "offset").show(rows, truncate=False)

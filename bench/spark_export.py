"""Benchmark: `spark.read.format("quire")` written to Parquet on local[2]
(or `--master`), against the two limits that bound it on the same machine
in the same run:

(a) a synthetic Python data source that yields as many rows of the same
    shape, as Arrow batches of the same size, without reading anything: the
    ceiling of Spark's Python-to-JVM path here;
(b) Spark rewriting the exported Parquet as Parquet: the engine's own limit.

3 bookies and a broker on loopback (E=3 WQ=3 AQ=2), a topic of `--gib` GiB
of 1 KiB messages, batched by the producer (no compression: the payloads are
random), closed ledgers of `--ledger-mib` MiB.

    .venv/bin/python -m bench.spark_export [--gib 1] [--partitions 2] [--standalone-workers 1 2]

With `--standalone-workers N...`, the same export again on a standalone
Spark cluster of N workers of one core each (quire.spark_standalone, as the
tests start it: the workers cannot see the checkout, quire's environment is
shipped to them), one cluster per N. On a 2-core machine those cores are
shared with the bookies, the broker, the master and the driver: it shows
contention as much as scaling. A `--master spark://...` cluster is given
quire's environment the same way.

Prints one JSON object per result, then a summary with the ratios; the
target is >= 0.7 x reference (a).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import trio
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from bench.cluster import bench_cluster, free_port
from broker.client import Client
from broker.export_plan import plan_splits
from broker.spark_source import ARROW_SCHEMA, BATCH_BYTES, SCHEMA, read_topic_ledgers
from quire import cli_ranges as ranges
from quire.cli_parsing import Bounded, Parser
from quire.progress import Progress
from quire.spark_shipping import is_local, start_session
from quire.spark_standalone import IsolationRefused, StandaloneCluster

CHECKOUT = Path(__file__).resolve().parents[1]
WORKERS_MAX = 64  # workers of one core each on this one machine

TOPIC = "bench-export"
MESSAGE_BYTES = 1024
TARGET_RATIO = 0.7


# --- the topic ------------------------------------------------------------------------------------


async def produce(zk_hosts: str, root: str, partitions: int, messages: int, ledger_bytes: int) -> float:
    """Fill the topic, then close its ledgers (unload); returns seconds taken."""
    blob = os.urandom(1 << 20)
    began = time.perf_counter()
    async with Client.connect(zk_hosts, root) as client:
        await client.create_topic(TOPIC, partitions=partitions, rollover_bytes=ledger_bytes, rollover_min_time_ms=0,
                                  ensemble_size=3, write_quorum=3, ack_quorum=2)
        producer = await client.create_producer(TOPIC, "bench", batching=True, pending_messages_max=20_000)
        with Progress("produce", total=messages / 1e6, unit="M messages") as bar:
            for number in range(messages):
                start = (number * 4099) % (len(blob) - MESSAGE_BYTES)
                await producer.send_async(blob[start:start + MESSAGE_BYTES], key=f"k{number % 100}",
                                          properties={"n": str(number % 10)} if number % 4 == 0 else None)
                if number % 10_000 == 0:
                    bar.update(number / 1e6)
            await producer.flush()
        await client.unload(TOPIC)  # closes every partition's last ledger: all of it is exportable
    return time.perf_counter() - began


# --- reference (a): rows of the same shape, read from nowhere -------------------------------------


def synthetic_batch(rows: int) -> pa.RecordBatch:
    """Rows like the topic's: distinct random 1 KiB payloads (so that
    Parquet has as much to write: no dictionary, nothing to compress), 100
    keys, properties on every fourth message."""
    payloads = pa.Array.from_buffers(pa.binary(), rows, [None, pa.py_buffer(
        b"".join((MESSAGE_BYTES * number).to_bytes(4, "little") for number in range(rows + 1))),
        pa.py_buffer(os.urandom(rows * MESSAGE_BYTES))])
    property_offsets = [0]
    for number in range(rows):
        property_offsets.append(property_offsets[-1] + (1 if number % 4 == 0 else 0))
    properties = pa.MapArray.from_arrays(pa.array(property_offsets, pa.int32()), pa.array(["n"] * property_offsets[-1]),
                                         pa.array(["1"] * property_offsets[-1]))
    columns = [
        pa.array([TOPIC] * rows, pa.string()),
        pa.array([0] * rows, pa.int32()),
        pa.array(range(rows), pa.int64()),
        pa.array([1] * rows, pa.int64()),
        pa.array([number // 1000 for number in range(rows)], pa.int64()),
        pa.array([number % 1000 for number in range(rows)], pa.int32()),
        pa.array([1_700_000_000_000_000] * rows, pa.timestamp("us", tz="UTC")),
        pa.array(["bench"] * rows, pa.string()),
        pa.array(range(rows), pa.int64()),
        pa.array([f"k{number % 100}" for number in range(rows)], pa.string()),
        properties,
        payloads,
    ]
    return pa.RecordBatch.from_arrays(columns, schema=ARROW_SCHEMA)


class SyntheticSource(DataSource):
    """Yields `rows` rows per input partition in batches of `batch_rows`:
    one batch built once and yielded again and again, reading nothing."""

    @classmethod
    def name(cls) -> str:
        return "quire_synthetic"

    def schema(self):
        return SCHEMA

    def reader(self, schema):
        return SyntheticReader(int(self.options["partitions"]), int(self.options["rows"]), int(self.options["batch_rows"]))


class SyntheticReader(DataSourceReader):
    def __init__(self, partitions: int, rows: int, batch_rows: int) -> None:
        self.partitions_count, self.rows, self.batch_rows = partitions, rows, batch_rows

    def partitions(self):
        return [InputPartition(index) for index in range(self.partitions_count)]

    def read(self, partition):
        batch = synthetic_batch(self.batch_rows)
        left = self.rows
        while left > 0:
            count = min(left, self.batch_rows)
            yield batch if count == self.batch_rows else batch.slice(0, count)
            left -= count


# --- measuring ------------------------------------------------------------------------------------


def timed_write(frame, path: Path) -> float:
    began = time.perf_counter()
    frame.write.mode("overwrite").parquet(str(path))
    return time.perf_counter() - began


def result(name: str, parameters: dict, rows: int, payload_bytes: int, elapsed_s: float) -> dict:
    return {
        "name": name,
        "parameters": parameters,
        "rows": rows,
        "elapsed_s": round(elapsed_s, 2),
        "rows_per_s": round(rows / elapsed_s, 1),
        "mb_per_s": round(payload_bytes / elapsed_s / 1e6, 2),
    }


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(prog=prog or "bench/spark_export.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=Bounded("number", 0, ranges.STORAGE_BYTES_MAX / ranges.GIB, low_open=True,
                                              why="more than a disk holds"),
                        default=1.0, help="payload in the topic (default %(default)s GiB)")
    parser.add_argument("--partitions", type=Bounded("integer", 1, ranges.PARTITIONS_MAX, why="the broker's limit"),
                        default=2, help="partitions of the topic")
    parser.add_argument("--ledger-mib", type=Bounded("integer", 1, ranges.STORAGE_BYTES_MAX // ranges.MIB, why="more than a disk holds"),
                        default=128, help="rollover size of the topic's ledgers")
    parser.add_argument("--master", default="local[2]", help="the Spark master of the main run (default %(default)s)")
    parser.add_argument("--standalone-workers", type=Bounded("integer", 1, WORKERS_MAX, why="cores of one machine"),
                        nargs="+", default=[], metavar="N",
                        help="also export on a standalone cluster of N one-core workers started here (one per N)")
    return parser


def quire_frame(spark, cluster, ledgers: list[int] | None = None):
    reader = spark.read.format("quire").option("zk", cluster.zk_hosts).option("root", cluster.root).option("topic", TOPIC)
    if ledgers is not None:
        reader = reader.option("ledgers", ",".join(map(str, ledgers)))
    return reader.load()


def standalone_run(cluster, workers: int, scratch: Path, parameters: dict, splits: list, messages: int,
                   payload_bytes: int) -> dict:
    """The quire source to Parquet on a standalone cluster of `workers`
    one-core workers, started for it (the checkout hidden from them when
    this machine allows) and stopped after."""
    base = scratch / f"standalone-{workers}"
    parameters = {**parameters, "master": f"standalone, {workers} worker{'s' if workers > 1 else ''} of 1 core",
                  "input_partitions": len(splits)}
    standalone = StandaloneCluster(base, workers, free_port, hidden=[CHECKOUT])
    try:
        standalone.start()
        parameters["workers_isolated"] = True
    except IsolationRefused:
        standalone.stop()
        standalone = StandaloneCluster(base, workers, free_port)
        standalone.start()
        parameters["workers_isolated"] = False
    try:
        # Every executor registered before a job starts, so each takes tasks.
        spark, stop = start_session(standalone.master_url, f"bench-spark-export-{workers}",
                                    {"spark.scheduler.minRegisteredResourcesRatio": "1.0"})
        try:
            # Warm up: executors started, the environment unpacked, a Python
            # worker on each (one small ledger per executor).
            warm_up = list(dict.fromkeys(split.ledger_id for split in sorted(splits, key=lambda split: split.bytes)))[:workers]
            quire_frame(spark, cluster, warm_up).write.format("noop").mode("overwrite").save()
            elapsed_s = timed_write(quire_frame(spark, cluster), base / "export")
            rows = spark.read.parquet(str(base / "export")).count()
            assert rows == messages, f"exported {rows} rows of {messages}"
        finally:
            stop()
    finally:
        standalone.stop()
    return result(f"quire source -> parquet (standalone, {workers} workers)", parameters, rows, payload_bytes, elapsed_s)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    arguments = build_parser(prog).parse_args(argv)
    messages = int(arguments.gib * (1 << 30)) // MESSAGE_BYTES
    payload_bytes = messages * MESSAGE_BYTES
    parameters = {"gib": arguments.gib, "message_bytes": MESSAGE_BYTES, "partitions": arguments.partitions,
                  "ledger_mib": arguments.ledger_mib, "master": arguments.master}
    # Executors on other machines (or hidden from the checkout) write outside it.
    local = is_local(arguments.master) and not arguments.standalone_workers
    scratch = Path(tempfile.mkdtemp(prefix="spark-export-",
                                    dir=Path(".bench").resolve() if local and Path(".bench").exists() else None))
    try:
        with bench_cluster(3, broker_count=1, root="/bench") as cluster:
            produce_s = trio.run(produce, cluster.zk_hosts, cluster.root, arguments.partitions, messages,
                                 arguments.ledger_mib << 20)
            print(json.dumps(result("produce (setup)", parameters, messages, payload_bytes, produce_s)), flush=True)
            chains = read_topic_ledgers(cluster.zk_hosts, cluster.root, TOPIC)
            splits = plan_splits(chains)
            spark, stop = start_session(arguments.master, "bench-spark-export")
            spark.dataSource.register(SyntheticSource)
            try:
                # Warm up first (Python workers started, modules imported,
                # the JVM's code compiled): a small read of each source.
                for frame in (quire_frame(spark, cluster, [splits[0].ledger_id]),
                              spark.read.format("quire_synthetic").option("partitions", "2").option("rows", "20000")
                              .option("batch_rows", "8192").load()):
                    frame.write.format("noop").mode("overwrite").save()
                quire_s = timed_write(quire_frame(spark, cluster), scratch / "export")
                rows = spark.read.parquet(str(scratch / "export")).count()
                assert rows == messages, f"exported {rows} rows of {messages}"
                quire = result("quire source -> parquet", {**parameters, "input_partitions": len(splits)}, rows, payload_bytes, quire_s)
                print(json.dumps(quire), flush=True)

                # The same number of rows and input partitions, batches of
                # the size the quire source yields (BATCH_BYTES of entries).
                batch_rows = BATCH_BYTES // MESSAGE_BYTES
                base, extra = divmod(messages, len(splits))
                synthetic = (spark.read.format("quire_synthetic").option("partitions", str(len(splits)))
                             .option("rows", str(base + (1 if extra else 0))).option("batch_rows", str(batch_rows)).load())
                synthetic_s = timed_write(synthetic, scratch / "synthetic")
                synthetic_rows = (base + (1 if extra else 0)) * len(splits)
                reference_a = result("reference (a): synthetic python source -> parquet",
                                     {**parameters, "input_partitions": len(splits), "batch_rows": batch_rows},
                                     synthetic_rows, synthetic_rows * MESSAGE_BYTES, synthetic_s)
                print(json.dumps(reference_a), flush=True)

                rewrite_s = timed_write(spark.read.parquet(str(scratch / "export")), scratch / "rewrite")
                reference_b = result("reference (b): parquet -> parquet", parameters, rows, payload_bytes, rewrite_s)
                print(json.dumps(reference_b), flush=True)
            finally:
                stop()
            standalone = []
            for workers in arguments.standalone_workers:
                standalone.append(standalone_run(cluster, workers, scratch, parameters, splits, messages, payload_bytes))
                print(json.dumps(standalone[-1]), flush=True)
        ratio_a = quire["mb_per_s"] / reference_a["mb_per_s"]
        ratio_b = quire["mb_per_s"] / reference_b["mb_per_s"]
        print(json.dumps({
            "name": "summary",
            "quire_mb_per_s": quire["mb_per_s"],
            "reference_a_mb_per_s": reference_a["mb_per_s"],
            "reference_b_mb_per_s": reference_b["mb_per_s"],
            "ratio_to_reference_a": round(ratio_a, 3),
            "ratio_to_reference_b": round(ratio_b, 3),
            "target": f">= {TARGET_RATIO} x reference (a)",
            "target_met": ratio_a >= TARGET_RATIO,
            "standalone_mb_per_s": {entry["parameters"]["master"]: entry["mb_per_s"] for entry in standalone},
            "cores": os.cpu_count(),
        }), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`quire export --master spark://…` on a standalone Spark cluster (a master
and two workers started from the pyspark package) whose workers cannot see
the project, as on machines of their own: each runs in a mount namespace
where the checkout (and .venv in it) is an empty tmpfs, with its own copy
of Spark. The export ships quire's environment by itself, runs on both
workers, is exact, and a second incremental run adds only the new closed
ledgers; --no-ship fails in one line; spark-submit with the same data
source works as docs/operations.md says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset
import pytest

from broker.client import Client
from broker.spark_source import read_topic_ledgers
from quire.spark_shipping import ALIAS
from quire.spark_standalone import IsolationRefused, StandaloneCluster, private_spark_copy, spark_home
from tests.integration.broker_processes import shared_cluster  # noqa: F401 (a fixture)
from tests.integration.test_spark_export import SMALL_LEDGERS, produce_mixed, read_all
from tests.support import cannot_run_here, free_port

CHECKOUT = Path(__file__).resolve().parents[2]
EXAMPLE = CHECKOUT / "docs" / "examples" / "spark_submit_export.py"
EXPORT_DEADLINE_S = 300  # a Spark application on a busy 2-core machine, the environment built if it is not cached


@pytest.fixture(scope="session")
def spark_copy(tmp_path_factory) -> Path:
    """Spark for the workers, outside the checkout they cannot see."""
    return private_spark_copy(tmp_path_factory.mktemp("spark-home") / "spark")


@pytest.fixture(scope="module")
def standalone(tmp_path_factory, spark_copy):
    base = tmp_path_factory.mktemp("standalone")
    assert not base.resolve().is_relative_to(CHECKOUT), "the workers' folders must be outside the checkout they cannot see"
    cluster = StandaloneCluster(base, workers=2, port=free_port, hidden=[CHECKOUT], spark=spark_copy)
    try:
        cluster.start()
    except IsolationRefused as error:
        cluster.stop()
        cannot_run_here(f"the Spark workers cannot be hidden from the checkout here: {error}")
    try:
        yield cluster
    finally:
        cluster.stop()


def client_environment(**extra: str) -> dict[str, str]:
    """This process's environment without what would choose the workers'
    Python (a local Spark session of this test run sets PYSPARK_PYTHON)."""
    environment = {name: value for name, value in os.environ.items() if not name.startswith("PYSPARK_")}
    environment.update(SPARK_LOCAL_IP="127.0.0.1", **extra)
    return environment


def run(command: list[str], cwd: Path, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=client_environment(**extra), capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=EXPORT_DEADLINE_S)


def export(cluster, standalone, topic: str, out: Path, cwd: Path, *extra: str, **environment: str):
    return run([sys.executable, "-m", "quire", "export", topic, "--zk", cluster.zk_hosts, "--root", cluster.root,
                "--master", standalone.master_url, "--out", f"file://{out}", "--incremental",
                # Both executors registered before the job starts: each gets tasks.
                "--conf", "spark.scheduler.minRegisteredResourcesRatio=1.0", *extra], cwd, **environment)


def executor_folders(standalone) -> dict[int, set[Path]]:
    """Each worker's executor folders (app-<id>/<executor id>/) so far."""
    return {index: set(standalone.worker_directory(index).glob("app-*/*/"))
            for index in range(1, standalone.workers + 1)}


def tasks_run(folder: Path) -> int:
    return (folder / "stderr").read_text(errors="replace").count("Executor: Running task")


def new_executors(standalone, before: dict[int, set[Path]]) -> dict[int, list[Path]]:
    after = executor_folders(standalone)
    return {index: sorted(after[index] - before[index]) for index in after}


def rows(directory: Path) -> dict[tuple, tuple]:
    """The export's rows read back with pyarrow, keyed by message id; a
    message exported twice fails."""
    table = pyarrow.dataset.dataset(directory, format="parquet", partitioning="hive").to_table(
        columns=["partition", "ledger_id", "entry_id", "batch_index", "offset", "key", "payload"])
    found = {}
    for row in table.to_pylist():
        key = (row["partition"], row["ledger_id"], row["entry_id"], row["batch_index"])
        assert key not in found, f"row {key} exported twice"
        found[key] = (row["offset"], row["key"], row["payload"])
    return found


def expected_rows(messages) -> dict[tuple, tuple]:
    return {(message.message_id.partition, message.message_id.ledger_id, message.message_id.entry_id,
             message.message_id.batch_index): (message.offset, message.key, message.data) for message in messages}


async def produce_closed(cluster, topic: str, count: int, tag: str, *, before: int = 0) -> list:
    """`count` messages (four codecs, some batched) in closed ledgers only
    (unloaded after) of a topic holding `before` messages (0: a new one);
    returns them as a reader receives them."""
    async with Client.connect(cluster.zk_hosts, cluster.root) as client:
        if not before:
            await client.create_topic(topic, partitions=2, **SMALL_LEDGERS)
        sent = await produce_mixed(client, topic, count, tag)
        await client.unload(topic)
        received = await read_all(client, topic, before + len(sent))
    wanted = {(result.message_id.ledger_id, result.message_id.entry_id, result.message_id.batch_index) for result in sent}
    return [message for message in received
            if (message.message_id.ledger_id, message.message_id.entry_id, message.message_id.batch_index) in wanted]


def ledgers_with_entries(cluster, topic: str) -> set[int]:
    return {info.ledger_id for chain in read_topic_ledgers(cluster.zk_hosts, cluster.root, topic)
            for info in chain.ledgers if info.is_closed and info.entries}


def test_the_workers_cannot_see_the_checkout(standalone):
    for name, process in standalone.processes:
        if name.startswith("worker-"):
            # /proc/PID/root resolves paths in the worker's mount namespace.
            assert os.listdir(f"/proc/{process.pid}/root{CHECKOUT}") == [], name
    assert any(CHECKOUT.iterdir()), "the checkout is still there for everyone else"


async def test_an_export_ships_quire_runs_on_both_workers_and_incremental_runs_add_only_new_ledgers(
        shared_cluster, standalone, tmp_path):
    topic = "standalone-export"
    out = tmp_path / "out"
    first = await produce_closed(shared_cluster, topic, 200, "first")
    before = executor_folders(standalone)
    result = export(shared_cluster, standalone, topic, out, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    executors = new_executors(standalone, before)
    for index, folders in executors.items():
        assert folders and sum(map(tasks_run, folders)) > 0, f"worker {index} ran no task:\n{standalone.log_tail(f'worker-{index}')}"
        for folder in folders:  # the archive, unpacked where the executor runs
            assert (folder / ALIAS / "bin" / "python").exists(), folder
    run_1 = rows(out / "run=1")
    assert run_1 == expected_rows(first) and len(run_1) == 200
    first_ledgers = {key[1] for key in run_1}
    assert first_ledgers == ledgers_with_entries(shared_cluster, topic), "every closed ledger that holds messages"

    second = await produce_closed(shared_cluster, topic, 120, "second", before=len(first))
    result = export(shared_cluster, standalone, topic, out, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    run_2 = rows(out / "run=2")
    assert run_2 == expected_rows(second) and len(run_2) == 120
    assert not {key[1] for key in run_2} & first_ledgers, "the second run wrote only new ledgers"
    assert sorted(path.name for path in out.iterdir()) == ["_lock", "run=1", "run=2"]


async def test_without_shipping_executors_lacking_quire_fail_in_one_line(shared_cluster, standalone, tmp_path):
    # The driver's Python has quire (this environment first on PATH, as
    # when it is activated); the workers' python3 has not.
    topic = "standalone-no-ship"
    await produce_closed(shared_cluster, topic, 40, "no-ship")
    before = executor_folders(standalone)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    result = export(shared_cluster, standalone, topic, tmp_path / "out", tmp_path, "--no-ship",
                    "--conf", "spark.pyspark.python=python3", PATH=path)
    assert result.returncode == 1, result.stderr[-4000:]
    [line] = [line for line in result.stderr.splitlines() if line.startswith("quire export: error:")]
    assert "the Spark job failed" in line and "--no-ship" in line, line
    assert "Traceback" not in result.stderr
    executors = new_executors(standalone, before)
    assert sum(tasks_run(folder) for folders in executors.values() for folder in folders) > 0, "it failed on the executors"
    assert not (tmp_path / "out" / "run=1").exists()


async def test_spark_submit_runs_the_same_data_source_with_the_shipped_environment(shared_cluster, standalone, tmp_path):
    # As docs/operations.md shows: the archive from quire.spark_shipping,
    # unpacked beside the driver too, and spark-submit of the example.
    topic = "standalone-submit"
    messages = await produce_closed(shared_cluster, topic, 80, "submit")
    archive = run([sys.executable, "-m", "quire.spark_shipping"], tmp_path)
    assert archive.returncode == 0, archive.stderr
    archive_path = archive.stdout.strip().splitlines()[-1]
    (tmp_path / ALIAS).mkdir()
    subprocess.run(["tar", "-xzf", archive_path, "-C", str(tmp_path / ALIAS)], check=True)
    out = tmp_path / "out"
    result = run([str(spark_home() / "bin" / "spark-submit"), "--master", standalone.master_url,
                  "--archives", f"{archive_path}#{ALIAS}", "--conf", f"spark.pyspark.python=./{ALIAS}/bin/python",
                  str(EXAMPLE), shared_cluster.zk_hosts, shared_cluster.root, topic, f"file://{out}"], tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"80 rows of {topic} written" in result.stdout
    assert rows(out) == expected_rows(messages)

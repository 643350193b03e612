"""What `quire export` ships to a Spark cluster: the pinned packages, quire's
own files, a hash that follows them, an archive built once and renamed into
place whole even when several builds race, and settings that keep what the
user gave."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from quire import spark_shipping
from quire.cli_parsing import UsageError
from quire.spark_shipping import ALIAS, WORKER_PYTHON, Recipe, prepare


def test_the_requirements_are_quires_and_the_spark_extras_pinned_as_installed_without_pyspark():
    pinned = dict(requirement.split("==") for requirement in spark_shipping.requirements())
    for name in ("kazoo", "trio", "msgpack", "rocksdict", "crc32c", "tqdm", "zstandard", "lz4", "prometheus-client",
                 "pyarrow", "pandas", "numpy"):
        assert pinned[name] == importlib.metadata.version(name), name
    assert not {"pyspark", "py4j", "venv-pack", "pytest", "matplotlib"} & set(pinned)


def test_the_constraints_pin_what_the_requirements_need_and_leave_out_pyspark():
    pinned = spark_shipping.requirements()
    constraints = dict(line.split("==") for line in spark_shipping.constraints(pinned))
    assert constraints["attrs"] == importlib.metadata.version("attrs")  # trio's
    assert constraints["python-dateutil"] == importlib.metadata.version("python-dateutil")  # pandas'
    assert not {"pyspark", "py4j"} & set(constraints)


def test_quires_files_are_taken_from_where_they_are_imported():
    files = dict(spark_shipping.package_files())
    import broker.spark_source

    assert files["broker/spark_source.py"] == Path(broker.spark_source.__file__)
    assert "quire/spark_shipping.py" in files and "coordination/__init__.py" in files
    assert {name.split("/")[0] for name in files} == set(spark_shipping.PACKAGES)
    assert not [name for name in files if "__pycache__" in name or not name.endswith(".py")]


def tiny_recipe(directory: Path, text: str = "VALUE = 1\n") -> Recipe:
    directory.mkdir(exist_ok=True)
    module = directory / "shipped.py"
    module.write_text(text)
    return Recipe((), (), (("quire_tiny/__init__.py", module),))


def test_the_hash_follows_the_code_and_the_dependencies(tmp_path):
    recipe = tiny_recipe(tmp_path)
    same = tiny_recipe(tmp_path)
    assert recipe.archive_hash() == same.archive_hash()
    changed = tiny_recipe(tmp_path / "other", "VALUE = 2\n")
    assert changed.archive_hash() != recipe.archive_hash()
    assert changed.dependencies_hash() == recipe.dependencies_hash(), "the code is not a dependency"
    pinned = Recipe(("msgpack==1.0.0",), (), recipe.files)
    assert pinned.dependencies_hash() != recipe.dependencies_hash()
    assert pinned.archive_hash() != recipe.archive_hash()
    elsewhere = Recipe((), (), recipe.files, python="3.12.1")
    assert elsewhere.archive_hash() != recipe.archive_hash()


BUILD = """
import sys
from pathlib import Path
from quire.spark_shipping import Recipe, build_archive
print(build_archive(Recipe((), (), (("quire_tiny/__init__.py", Path(sys.argv[1])),)), Path(sys.argv[2])))
"""


def test_builds_racing_for_one_archive_leave_one_whole_archive(tmp_path):
    # Three processes build the same archive into one cache at once: they
    # wait for each other, all name the same file, and it is whole.
    module = tmp_path / "shipped.py"
    module.write_text("VALUE = 1\n")
    cache = tmp_path / "cache"
    environment = {**os.environ, "CI": "true"}
    builders = [subprocess.Popen([sys.executable, "-c", BUILD, str(module), str(cache)], stdout=subprocess.PIPE,
                                 text=True, env=environment) for _ in range(3)]
    outputs = [builder.communicate(timeout=120)[0].strip() for builder in builders]
    assert [builder.returncode for builder in builders] == [0, 0, 0]
    assert len(set(outputs)) == 1
    archive = Path(outputs[0])
    assert archive.parent == cache and archive.name.endswith(".tar.gz")
    with tarfile.open(archive) as packed:
        names = packed.getnames()
    assert "lib/python%d.%d/site-packages/quire_tiny/__init__.py" % sys.version_info[:2] in names
    assert "bin/python" in names and "pyvenv.cfg" in names
    assert [path.name for path in cache.iterdir() if path.name.endswith(".partial")] == []
    assert build_again(module, cache) == archive  # cached: not built again


def build_again(module: Path, cache: Path) -> Path:
    output = subprocess.run([sys.executable, "-c", BUILD, str(module), str(cache)], capture_output=True, text=True,
                            env={**os.environ, "CI": ""}, check=True)
    assert "building the environment" not in output.stderr
    return Path(output.stdout.strip())


@pytest.fixture
def archive(monkeypatch, tmp_path) -> Path:
    """build_archive answers at once with a path (no environment is built)."""
    path = tmp_path / "cache" / "0123.tar.gz"
    monkeypatch.setattr(spark_shipping, "build_archive", lambda: path)
    return path


def test_a_local_master_ships_nothing(archive):
    launch = prepare("local[2]", {"spark.archives": "x.tar.gz#x"})
    assert launch.config == {"spark.archives": "x.tar.gz#x"} and launch.python is None and launch.directory is None


def test_a_cluster_master_ships_the_archive_after_the_users_and_starts_the_driver_beside_this_environment(
        archive, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    launch = prepare("spark://127.0.0.1:7077", {"spark.archives": "mine.tar.gz#mine,hdfs:///shared.zip",
                                                "spark.files": "notes.txt"})
    directory = launch.directory
    try:
        assert launch.config["spark.archives"] == f"{tmp_path}/mine.tar.gz#mine,hdfs:///shared.zip,{archive}#{ALIAS}"
        assert launch.config["spark.files"] == f"{tmp_path}/notes.txt", "resolved before the JVM starts elsewhere"
        assert launch.python == WORKER_PYTHON == launch.config["spark.pyspark.python"]
        # The driver's JVM finds ./quire-env/bin/python there: this environment's.
        assert os.path.samefile(launch.directory / WORKER_PYTHON, Path(sys.prefix) / "bin" / "python")
    finally:
        launch.close()
    assert not directory.exists()


def test_a_python_the_user_gives_is_kept(archive):
    launch = prepare("spark://127.0.0.1:7077", {"spark.pyspark.python": "/opt/python/bin/python3"})
    assert launch.python == "/opt/python/bin/python3" and launch.directory is None
    assert launch.config["spark.archives"] == f"{archive}#{ALIAS}"


def test_an_archive_of_the_users_under_the_same_name_is_refused(archive):
    with pytest.raises(UsageError, match="--no-ship"):
        prepare("spark://127.0.0.1:7077", {"spark.archives": f"mine.tar.gz#{ALIAS}"})


def test_without_shipping_the_users_python_runs(archive, monkeypatch):
    monkeypatch.setenv("PYSPARK_PYTHON", "/usr/bin/python3")
    launch = prepare("spark://127.0.0.1:7077", {}, ship=False)
    assert launch.python == "/usr/bin/python3" and "spark.archives" not in launch.config
    launch = prepare("spark://127.0.0.1:7077", {"spark.archives": "env.tar.gz#env",
                                                "spark.pyspark.python": "./env/bin/python"}, ship=False)
    try:
        assert launch.python == "./env/bin/python" and (launch.directory / "env").resolve() == Path(sys.prefix).resolve()
    finally:
        launch.close()

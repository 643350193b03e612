"""Fixtures for tests against real processes: one ZooKeeper for the whole
session, and a fresh chroot per test so tests never see each other's nodes."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from coordination.zk_launcher import ZooKeeperServer
from tests.support import free_port

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    # Hooks in a conftest see every collected item, so pick this folder's.
    for item in items:
        if item.path.is_relative_to(_HERE):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def zookeeper(tmp_path_factory):
    server = ZooKeeperServer(free_port(), tmp_path_factory.mktemp("zookeeper"), die_with_parent=True)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def zk_hosts(zookeeper) -> str:
    return zookeeper.address


@pytest.fixture
def zk_root(zk_hosts):
    root = f"/t-{uuid.uuid4().hex}"
    yield root
    # Imported here so that collecting the launcher tests does not need kazoo.
    from coordination.zk_store import KazooMetadataStore

    with KazooMetadataStore.connect(zk_hosts, "/", session_timeout_ms=4_000) as whole_tree:
        if whole_tree.exists(root) is not None:
            whole_tree.delete(root, recursive=True)

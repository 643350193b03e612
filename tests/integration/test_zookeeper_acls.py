"""ZooKeeper is not an open door: a cluster whose processes all run with
--zk-auth keeps its metadata under digest ACLs. Real bookies and a broker
serve, a client with the same identity produces and consumes, and an
anonymous kazoo client can neither read nor change quire's nodes."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
import trio
from kazoo import exceptions as kazoo_errors
from kazoo.client import KazooClient

from broker.client import Client
from coordination.zk_store import set_digest_auth
from tests.integration.bookie_processes import BookieFactory
from tests.integration.broker_processes import BrokerFactory
from tests.integration.processes import print_logs

pytestmark = pytest.mark.integration

ZK_AUTH = "quire:s3cret"


@pytest.fixture
def digest_identity():
    set_digest_auth(ZK_AUTH)
    try:
        yield
    finally:
        set_digest_auth(None)


async def test_an_anonymous_zookeeper_client_cannot_read_or_change_quires_metadata(zookeeper, tmp_path, digest_identity):
    root = f"/acl-{uuid.uuid4().hex}"
    bookies = BookieFactory(zookeeper.address, root, tmp_path)
    brokers = BrokerFactory(zookeeper.address, root, tmp_path)
    try:
        for _ in range(3):
            await bookies.started("--zk-auth", ZK_AUTH)
        await brokers.started("--zk-auth", ZK_AUTH)
        async with Client.connect(zookeeper.address, root) as client:
            producer = await client.create_producer("behind-acls", "p")
            await producer.send(b"kept")
            reader = await client.create_reader("behind-acls", start="earliest")
            assert (await reader.receive()).data == b"kept"

        def anonymous_attempts() -> dict[str, type]:
            anonymous = KazooClient(hosts=zookeeper.address)
            anonymous.start(timeout=10)
            outcomes = {}
            attempts = {
                "list the cluster's nodes": lambda: anonymous.get_children(root),
                "read a topic": lambda: anonymous.get(f"{root}/topics/behind-acls"),
                "change a topic": lambda: anonymous.set(f"{root}/topics/behind-acls", b"{}"),
                "delete the managed ledger": lambda: anonymous.delete(f"{root}/managed-ledgers/behind-acls", recursive=True),
                "register a bookie": lambda: anonymous.create(f"{root}/bookies/writable/evil:1", b"{}"),
                "read the ledgers": lambda: anonymous.get_children(f"{root}/ledgers"),
            }
            try:
                for what, attempt in attempts.items():
                    try:
                        attempt()
                        outcomes[what] = type(None)
                    except kazoo_errors.KazooException as error:
                        outcomes[what] = type(error)
            finally:
                anonymous.stop()
                anonymous.close()
            return outcomes

        outcomes = await trio.to_thread.run_sync(anonymous_attempts)
        assert outcomes == dict.fromkeys(outcomes, kazoo_errors.NoAuthError), outcomes
        # Commands given the identity work; without it they are refused in one line.
        listed = await trio.to_thread.run_sync(lambda: subprocess.run(
            [sys.executable, "-m", "quire", "topic", "ls", "--zk", zookeeper.address, "--root", root, "--zk-auth", ZK_AUTH],
            capture_output=True, text=True, timeout=60))
        assert listed.returncode == 0 and "behind-acls" in listed.stdout, listed.stderr
        refused = await trio.to_thread.run_sync(lambda: subprocess.run(
            [sys.executable, "-m", "quire", "ledger", "ls", "--zk", zookeeper.address, "--root", root],
            capture_output=True, text=True, timeout=60, env={k: v for k, v in __import__("os").environ.items()
                                                             if k != "QUIRE_ZK_AUTH"}))
        assert refused.returncode != 0 and "not allowed" in refused.stderr, refused.stderr
    finally:
        brokers.stop_all()
        bookies.stop_all()
        print_logs(bookies.created + brokers.created)

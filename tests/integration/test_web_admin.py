"""The brokers' web service on real processes (3 bookies, ZooKeeper):
Pulsar's REST admin API called with `requests` as a user's script calls it
(paths, JSON bodies and status codes of Pulsar's `/admin/v2`), HTTP lookup
used by the official Pulsar client given an http:// service URL, and
/metrics. Each test uses tenants and topics of its own."""

from __future__ import annotations

import time
import uuid

import pulsar
import pytest
import requests
import trio

from broker.client import Client
from tests.integration.bookie_processes import bookies  # noqa: F401 (fixtures)
from tests.integration.broker_processes import brokers, shared_cluster  # noqa: F401
from tests.support import wait_until_async

pytestmark = pytest.mark.integration

V2 = "/admin/v2"
RECEIVE_TIMEOUT_MS = 20_000


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


class Rest:
    """Blocking REST calls on one broker's web service."""

    def __init__(self, url: str, token: str | None = None) -> None:
        self.url = url
        self.headers = {} if token is None else {"Authorization": f"Bearer {token}"}

    def call(self, method: str, path: str, body=None, **options) -> requests.Response:
        return requests.request(method, self.url + path, json=body, headers=self.headers, timeout=30, **options)

    async def __call__(self, method: str, path: str, body=None, **options) -> requests.Response:
        return await trio.to_thread.run_sync(lambda: self.call(method, path, body, **options))


def pulsar_client(url: str) -> pulsar.Client:
    return pulsar.Client(url, operation_timeout_seconds=20, io_threads=1, message_listener_threads=1,
                         logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn))


async def new_namespace(rest: Rest, prefix: str) -> str:
    """A tenant of its own and its namespace `ns`, made over REST."""
    tenant = unique(prefix)
    assert (await rest("PUT", f"{V2}/tenants/{tenant}", {"allowedClusters": ["standalone"]})).status_code == 204
    assert (await rest("PUT", f"{V2}/namespaces/{tenant}/ns")).status_code == 204
    return f"{tenant}/ns"


async def produce(cluster, topic: str, count: int) -> None:
    async with Client.connect(cluster.zk_hosts, cluster.root) as client:
        producer = await client.create_producer(topic, unique("p"))
        for index in range(count):
            await producer.send(f"m{index}".encode())


async def test_clusters_tenants_and_namespaces_answer_as_pulsar(shared_cluster):
    rest = Rest(shared_cluster.brokers[0].web_url)
    tenant = unique("acme")
    namespace = f"{tenant}/ns"

    assert (await rest("GET", V2 + "/clusters")).json() == ["standalone"]
    cluster = (await rest("GET", V2 + "/clusters/standalone")).json()
    assert cluster["serviceUrl"] == shared_cluster.brokers[0].web_url
    assert cluster["brokerServiceUrl"] == shared_cluster.brokers[0].pulsar_url
    assert (await rest("GET", V2 + "/clusters/elsewhere")).status_code == 404
    assert (await rest("GET", V2 + "/brokers/standalone")).json() == [f"127.0.0.1:{shared_cluster.brokers[0].web_port}"]
    health = await rest("GET", V2 + "/brokers/health")
    assert (health.status_code, health.text) == (200, "ok")

    # Tenants: made, refused twice, read, listed; clusters must exist.
    info = {"adminRoles": ["ops"], "allowedClusters": ["standalone"]}
    assert (await rest("PUT", f"{V2}/tenants/{tenant}", info)).status_code == 204
    assert (await rest("PUT", f"{V2}/tenants/{tenant}", info)).status_code == 409
    assert (await rest("GET", f"{V2}/tenants/{tenant}")).json() == info
    assert tenant in (await rest("GET", V2 + "/tenants")).json()
    refused = await rest("PUT", f"{V2}/tenants/{unique('other')}", {"allowedClusters": ["nowhere"]})
    assert refused.status_code == 412 and "nowhere" in refused.json()["reason"]
    assert (await rest("POST", f"{V2}/tenants/{tenant}", {"adminRoles": ["ops", "dev"], "allowedClusters": []})).status_code == 204
    assert (await rest("GET", f"{V2}/tenants/{tenant}")).json()["adminRoles"] == ["dev", "ops"]

    # Namespaces and their policies for their topics.
    assert (await rest("PUT", f"{V2}/namespaces/{namespace}")).status_code == 204
    assert (await rest("PUT", f"{V2}/namespaces/{namespace}")).status_code == 409
    assert (await rest("GET", f"{V2}/namespaces/{tenant}")).json() == [namespace]
    assert (await rest("GET", f"{V2}/namespaces/{namespace}/retention")).status_code == 204  # not set
    retention = {"retentionTimeInMinutes": 60, "retentionSizeInMB": 100}
    assert (await rest("POST", f"{V2}/namespaces/{namespace}/retention", retention)).status_code == 204
    assert (await rest("GET", f"{V2}/namespaces/{namespace}/retention")).json() == retention
    assert (await rest("POST", f"{V2}/namespaces/{namespace}/deduplication", False)).status_code == 204
    assert (await rest("GET", f"{V2}/namespaces/{namespace}/deduplication")).json() is False
    quota = {"limitSize": 1 << 20, "policy": "producer_exception"}
    assert (await rest("POST", f"{V2}/namespaces/{namespace}/backlogQuota", quota)).status_code == 204
    assert (await rest("GET", f"{V2}/namespaces/{namespace}/backlogQuotaMap")).json()["destination_storage"]["limitSize"] == 1 << 20
    assert (await rest("POST", f"{V2}/namespaces/{namespace}/backlogQuota", {"limitSize": 1, "policy": "consumer_backlog_eviction"})).status_code == 501
    # Pulsar sets a namespace's compaction threshold with PUT.
    assert (await rest("PUT", f"{V2}/namespaces/{namespace}/compactionThreshold", 100 << 20)).status_code == 204
    assert (await rest("GET", f"{V2}/namespaces/{namespace}/compactionThreshold")).json() == 100 << 20
    policies = (await rest("GET", f"{V2}/namespaces/{namespace}")).json()
    assert policies["retention_policies"] == retention and policies["deduplicationEnabled"] is False
    assert (await rest("DELETE", f"{V2}/namespaces/{namespace}/retention")).status_code == 204
    assert (await rest("GET", f"{V2}/namespaces/{namespace}")).json()["retention_policies"] is None

    # Grants.
    assert (await rest("POST", f"{V2}/namespaces/{namespace}/permissions/app", ["produce"])).status_code == 204
    assert (await rest("GET", f"{V2}/namespaces/{namespace}/permissions")).json() == {"app": ["produce"]}
    assert (await rest("POST", f"{V2}/namespaces/{namespace}/permissions/app", ["fly"])).status_code == 400
    assert (await rest("DELETE", f"{V2}/namespaces/{namespace}/permissions/app")).status_code == 204
    assert (await rest("GET", f"{V2}/namespaces/{namespace}/permissions")).json() == {}

    # A tenant with namespaces, a namespace with topics, stay.
    await produce(shared_cluster, f"{namespace}/orders", 1)
    assert (await rest("DELETE", f"{V2}/tenants/{tenant}")).status_code == 409
    assert (await rest("DELETE", f"{V2}/namespaces/{namespace}")).status_code == 409
    assert (await rest("DELETE", f"{V2}/persistent/{namespace}/orders")).status_code == 204
    assert (await rest("DELETE", f"{V2}/namespaces/{namespace}")).status_code == 204
    assert (await rest("DELETE", f"{V2}/tenants/{tenant}")).status_code == 204
    assert (await rest("GET", f"{V2}/tenants/{tenant}")).status_code == 404


async def test_a_namespace_policy_reaches_its_topics_unless_a_topic_sets_its_own(shared_cluster):
    rest = Rest(shared_cluster.brokers[0].web_url)
    namespace = await new_namespace(rest, "dedup")
    topic = f"persistent://{namespace}/orders"
    assert (await rest("PUT", f"{V2}/persistent/{namespace}/orders")).status_code == 204

    async def deduplication_is(expected: str) -> bool:
        stats = (await rest("GET", f"{V2}/persistent/{namespace}/orders/stats")).json()
        return stats["deduplicationStatus"] == expected

    def resend(producer_name: str) -> None:
        """Send sequence ids 1..5 twice from one producer name, as a
        producer does after a restart (the Python client takes a sequence
        id of 0 for none given)."""
        client = pulsar_client(shared_cluster.brokers[0].pulsar_url)
        try:
            for _ in range(2):
                producer = client.create_producer(topic, producer_name=producer_name, batching_enabled=False)
                for sequence_id in range(1, 6):
                    producer.send(b"x", sequence_id=sequence_id)
                producer.close()
        finally:
            client.close()

    async def stored() -> int:
        return (await rest("GET", f"{V2}/persistent/{namespace}/orders/stats")).json()["msgInCounter"]

    assert await deduplication_is("Enabled")  # quire's default
    assert (await rest("POST", f"{V2}/namespaces/{namespace}/deduplication", False)).status_code == 204
    # Loaded partitions take their namespace's policies at their next check (every 0.5 s here).
    await wait_until_async(lambda: deduplication_is("Disabled"), deadline_s=15, poll_s=0.2,
                           what="the namespace's policy reaching its topic")
    await trio.to_thread.run_sync(resend, "resender")
    assert await stored() == 10  # deduplication off: both rounds stored

    assert (await rest("POST", f"{V2}/namespaces/{namespace}/deduplication", True)).status_code == 204
    await wait_until_async(lambda: deduplication_is("Enabled"), deadline_s=15, poll_s=0.2,
                           what="the namespace's policy reaching its topic")
    await trio.to_thread.run_sync(resend, "resender-2")
    assert await stored() == 15  # the second round dropped

    # A topic's own setting wins over its namespace's; removed, the namespace's applies again.
    topic_path = f"{V2}/persistent/{namespace}/orders"
    assert (await rest("GET", topic_path + "/deduplicationEnabled")).status_code == 204  # the topic sets none
    assert (await rest("POST", topic_path + "/deduplicationEnabled", False)).status_code == 204
    assert (await rest("GET", topic_path + "/deduplicationEnabled")).json() is False
    assert (await rest("GET", topic_path + "/retention?applied=true")).json() == {"retentionTimeInMinutes": -1,
                                                                                  "retentionSizeInMB": -1}
    await wait_until_async(lambda: deduplication_is("Disabled"), deadline_s=15, poll_s=0.2,
                           what="the topic's own policy")
    assert (await rest("DELETE", topic_path + "/deduplicationEnabled")).status_code == 204
    await wait_until_async(lambda: deduplication_is("Enabled"), deadline_s=15, poll_s=0.2,
                           what="the namespace's policy again")
    assert (await rest("POST", topic_path + "/messageTTL?messageTTL=3600")).status_code == 204
    assert (await rest("GET", topic_path + "/messageTTL")).json() == 3600


async def test_topics_stats_and_subscriptions_over_rest(shared_cluster):
    rest = Rest(shared_cluster.brokers[0].web_url)
    name = unique("rest")
    path = f"{V2}/persistent/public/default/{name}"

    assert (await rest("PUT", path)).status_code == 204
    assert (await rest("PUT", path)).status_code == 409
    assert (await rest("GET", path + "/partitions")).json() == {"partitions": 0}
    assert f"persistent://public/default/{name}" in (await rest("GET", f"{V2}/persistent/public/default")).json()
    await produce(shared_cluster, name, 10)

    # A subscription made at the earliest message, then moved by each admin call.
    assert (await rest("PUT", path + "/subscription/audit", {"ledgerId": -1, "entryId": -1})).status_code == 204
    assert (await rest("PUT", path + "/subscription/audit")).status_code == 409
    assert (await rest("GET", path + "/subscriptions")).json() == ["audit"]

    async def backlog() -> int:
        return (await rest("GET", path + "/stats")).json()["subscriptions"]["audit"]["msgBacklog"]

    assert await backlog() == 10
    assert (await rest("POST", path + "/subscription/audit/skip/3")).status_code == 204
    assert await backlog() == 7
    assert (await rest("POST", path + "/subscription/audit/skip_all")).status_code == 204
    assert await backlog() == 0
    assert (await rest("POST", path + "/subscription/audit/resetcursor/0")).status_code == 204
    assert await backlog() == 10
    assert (await rest("POST", path + "/subscription/audit/expireMessages/3600")).status_code == 204
    assert await backlog() == 10  # nothing is an hour old
    assert (await rest("POST", path + "/subscription/audit/expireMessages/0")).status_code == 204
    assert await backlog() == 0
    internal = (await rest("GET", path + "/internalStats")).json()
    assert internal["ledgers"] and internal["cursors"]["audit"]["markDeleteOffset"] == 9
    first = internal["ledgers"][0]
    assert (await rest("POST", path + "/subscription/audit/resetcursor",
                       {"ledgerId": first["ledgerId"], "entryId": 0})).status_code == 204
    assert await backlog() == 10
    assert (await rest("POST", path + "/subscription/missing/skip/1")).status_code == 404

    # Reset to a time between two sends: the messages published from then on are the backlog.
    await trio.sleep(0.05)
    between_ms = int(time.time() * 1000)
    await trio.sleep(0.05)
    await produce(shared_cluster, name, 4)
    assert (await rest("POST", path + f"/subscription/audit/resetcursor/{between_ms}")).status_code == 204
    assert await backlog() == 4

    stats = (await rest("GET", path + "/stats")).json()
    assert stats["msgInCounter"] == 14 and stats["storageSize"] > 0
    assert (await rest("PUT", path + "/unload")).status_code == 204
    assert (await rest("DELETE", path + "/subscription/audit")).status_code == 204
    assert (await rest("GET", path + "/subscriptions")).json() == []
    assert (await rest("DELETE", path)).status_code == 204
    assert (await rest("GET", path + "/stats")).status_code == 404


async def test_a_partitioned_topic_made_over_rest_is_used_by_a_pulsar_client_over_http_lookup(shared_cluster):
    broker = shared_cluster.brokers[0]
    rest = Rest(broker.web_url)
    name = unique("parts")
    path = f"{V2}/persistent/public/default/{name}"
    assert (await rest("PUT", path + "/partitions", 0)).status_code == 406
    assert (await rest("PUT", path + "/partitions", 3)).status_code == 204
    assert (await rest("PUT", path + "/partitions", 3)).status_code == 409
    assert (await rest("GET", path + "/partitions")).json() == {"partitions": 3}
    assert f"persistent://public/default/{name}" in (await rest("GET", f"{V2}/persistent/public/default/partitioned")).json()
    assert (await rest("PUT", path + "/subscription/all", {"ledgerId": -1, "entryId": -1})).status_code == 204

    lookup = (await rest("GET", f"/lookup/v2/topic/persistent/public/default/{name}-partition-1")).json()
    assert lookup["brokerUrl"] == broker.pulsar_url and lookup["httpUrl"] == broker.web_url

    def use() -> list[bytes]:
        client = pulsar_client(broker.web_url)  # an http:// service URL: HTTP lookup
        try:
            producer = client.create_producer(f"persistent://public/default/{name}", batching_enabled=False)
            for index in range(12):
                producer.send(f"m{index}".encode(), partition_key=f"k{index}")
            consumer = client.subscribe(f"persistent://public/default/{name}", "all",
                                        consumer_type=pulsar.ConsumerType.Shared)
            received = []
            for _ in range(12):
                message = consumer.receive(RECEIVE_TIMEOUT_MS)
                received.append(message.data())
                consumer.acknowledge(message)
            return received
        finally:
            client.close()

    received = await trio.to_thread.run_sync(use)
    assert sorted(received) == sorted(f"m{index}".encode() for index in range(12))
    stats = (await rest("GET", path + "/partitioned-stats")).json()
    assert stats["msgInCounter"] == 12 and stats["metadata"] == {"partitions": 3}
    assert sum(partition["msgInCounter"] for partition in stats["partitions"].values()) == 12
    assert stats["subscriptions"]["all"]["msgBacklog"] == 0
    internal = (await rest("GET", path + "/partitioned-internalStats")).json()
    assert len(internal["partitions"]) == 3
    assert (await rest("GET", path + "/stats")).status_code == 404  # a partitioned topic's are partitioned-stats
    assert (await rest("DELETE", path + "/partitions?force=true")).status_code == 204
    assert (await rest("GET", path + "/partitions")).json() == {"partitions": 0}


async def test_bad_requests_get_clear_errors_and_the_broker_serves_on(shared_cluster):
    rest = Rest(shared_cluster.brokers[0].web_url)
    assert (await rest("PUT", f"{V2}/tenants/{unique('t')}", data=b"{not json")).status_code == 400
    too_big = await rest("PUT", f"{V2}/tenants/{unique('t')}", data=b"[" + b"1," * 600_000 + b"1]")
    assert too_big.status_code == 400 and "at most" in too_big.json()["reason"]
    assert (await rest("GET", f"{V2}/persistent/public/default/{unique('none')}/stats")).status_code == 404
    assert (await rest("GET", f"{V2}/persistent/public/default/{unique('none')}/subscription/s/skip/x")).status_code == 405
    assert (await rest("POST", f"{V2}/persistent/public/default/{unique('x')}/subscription/s/skip/-1")).status_code == 400
    assert (await rest("GET", "/admin/v2/nothing-here")).status_code == 404
    assert (await rest("GET", V2 + "/clusters")).status_code == 200


async def test_metrics_are_served_on_the_web_port(shared_cluster):
    def scrape() -> str:
        return requests.get(shared_cluster.brokers[0].web_url + "/metrics", timeout=30).text

    text = await trio.to_thread.run_sync(scrape)
    assert "quire_broker_" in text and "process_cpu_seconds_total" in text



async def test_any_broker_answers_for_partitions_another_serves(zk_hosts, zk_root, bookies, brokers):
    # Two brokers: the partitions of a topic spread over both. Each broker
    # answers for every partition (it asks the owner and relays its answer),
    # puts a partitioned topic's stats together from both, and answers HTTP
    # lookups naming the owner.
    for _ in range(3):
        await bookies.started()
    first, second = await brokers.started(), await brokers.started()
    name = unique("spread")
    rests = [Rest(first.web_url), Rest(second.web_url)]
    both = sorted(f"127.0.0.1:{broker.web_port}" for broker in (first, second))

    async def each_sees_both() -> bool:
        for rest in rests:
            if (await rest("GET", V2 + "/brokers/standalone")).json() != both:
                return False
        return True

    # Lookups spread partitions over the brokers each one sees registered.
    await wait_until_async(each_sees_both, deadline_s=20, poll_s=0.1, what="both brokers registered")
    path = f"{V2}/persistent/public/default/{name}"
    # 16 partitions: rendezvous hashing puts all on one broker once in 2^15.
    assert (await rests[0]("PUT", path + "/partitions", 16)).status_code == 204
    async with Client.connect(zk_hosts, zk_root) as client:
        producer = await client.create_producer(name, unique("p"))
        for index in range(40):
            await producer.send(f"m{index}".encode(), key=f"k{index}")
        owners = {await client.lookup(f"{name}-partition-{index}") for index in range(16)}
    assert owners == {first.address, second.address}, "the partitions did not spread over both brokers"

    for rest in rests:
        stats = (await rest("GET", path + "/partitioned-stats")).json()
        assert stats["msgInCounter"] == 40 and len(stats["partitions"]) == 16
        for index in range(16):
            partition = await rest("GET", f"{path}-partition-{index}/stats")
            assert partition.status_code == 200, partition.text
            lookup = (await rest("GET", f"/lookup/v2/topic/persistent/public/default/{name}-partition-{index}")).json()
            assert lookup["brokerUrl"] in (first.pulsar_url, second.pulsar_url)
    assert (await rests[1]("PUT", path + "/subscription/audit", {"ledgerId": -1, "entryId": -1})).status_code == 204
    stats = (await rests[0]("GET", path + "/partitioned-stats")).json()
    assert stats["subscriptions"]["audit"]["msgBacklog"] == 40
    assert (await rests[0]("POST", path + "/subscription/audit/skip_all")).status_code == 204
    assert (await rests[1]("GET", path + "/partitioned-stats")).json()["subscriptions"]["audit"]["msgBacklog"] == 0
    assert (await rests[1]("PUT", path + "/unload")).status_code == 204
    assert (await rests[0]("DELETE", path + "/partitions")).status_code == 204
    assert (await rests[1]("GET", path + "/partitions")).json() == {"partitions": 0}


def quire(cluster, *arguments: str) -> dict | str:
    """`quire ARGUMENTS` against the cluster; its output, as JSON when it is."""
    import json
    import subprocess
    import sys

    completed = subprocess.run([sys.executable, "-m", "quire", *arguments, "--zk", cluster.zk_hosts, "--root", cluster.root],
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    try:
        return json.loads(completed.stdout)
    except ValueError:
        return completed.stdout


async def test_the_command_line_and_the_rest_api_do_the_same_admin_actions(shared_cluster, tmp_path):
    rest = Rest(shared_cluster.brokers[0].web_url)
    tenant, name = unique("cli"), unique("subs")
    namespace = f"{tenant}/ns"
    path = f"{V2}/persistent/public/default/{name}"

    def run(*arguments: str):
        return quire(shared_cluster, *arguments)

    await produce(shared_cluster, name, 6)
    await trio.to_thread.run_sync(run, "topic", "create-subscription", name, "--subscription", "s", "--position", "earliest")
    assert (await rest("GET", path + "/subscriptions")).json() == ["s"]
    await trio.to_thread.run_sync(run, "topic", "skip", name, "--subscription", "s", "--count", "2")
    assert (await rest("GET", path + "/stats")).json()["subscriptions"]["s"]["msgBacklog"] == 4
    await trio.to_thread.run_sync(run, "topic", "expire", name, "--subscription", "s", "--older-than", "0s")
    assert (await rest("GET", path + "/stats")).json()["subscriptions"]["s"]["msgBacklog"] == 0
    await trio.to_thread.run_sync(run, "topic", "reset-cursor", name, "--subscription", "s", "--ago", "1h")
    assert (await rest("GET", path + "/stats")).json()["subscriptions"]["s"]["msgBacklog"] == 6
    assert (await trio.to_thread.run_sync(run, "topic", "subscriptions", name)).split() == ["s"]
    await trio.to_thread.run_sync(run, "topic", "delete-subscription", name, "--subscription", "s")
    assert (await rest("GET", path + "/subscriptions")).json() == []

    definition = tmp_path / "event.avsc"
    definition.write_text('{"type": "record", "name": "Event", "fields": [{"name": "id", "type": "long"}]}')
    await trio.to_thread.run_sync(run, "topic", "set-schema", name, "--type", "AVRO", "--definition-file", str(definition))
    schema = (await rest("GET", f"{V2}/schemas/public/default/{name}/schema")).json()
    assert schema["version"] == 0 and schema["type"] == "AVRO"
    assert (await trio.to_thread.run_sync(run, "topic", "schema", name))["definition"] == definition.read_text()

    assert (await rest("PUT", f"{V2}/tenants/{tenant}", {"allowedClusters": ["standalone"]})).status_code == 204
    await trio.to_thread.run_sync(run, "namespace", "create", namespace)
    await trio.to_thread.run_sync(run, "namespace", "set-policies", namespace, "--retention-time", "2h", "--retention-size", "none",
                                  "--deduplication", "off")
    assert (await rest("GET", f"{V2}/namespaces/{namespace}/retention")).json() == {"retentionTimeInMinutes": 120,
                                                                                     "retentionSizeInMB": -1}
    assert (await rest("GET", f"{V2}/namespaces/{namespace}/deduplication")).json() is False
    policies = await trio.to_thread.run_sync(run, "namespace", "remove-policies", namespace, "--policies", "deduplication")
    assert "deduplication" not in policies["policies"]
    assert (await trio.to_thread.run_sync(run, "namespace", "policies", namespace))["policies"] == {
        "retention_bytes": None, "retention_time_ms": 7_200_000}


async def test_message_ttl_set_over_rest_expires_messages_on_every_subscription(shared_cluster):
    rest = Rest(shared_cluster.brokers[0].web_url)
    namespace = await new_namespace(rest, "ttl")
    path = f"{V2}/persistent/{namespace}/events"
    assert (await rest("PUT", path)).status_code == 204
    for subscription in ("a", "b"):
        assert (await rest("PUT", f"{path}/subscription/{subscription}")).status_code == 204
    await produce(shared_cluster, f"{namespace}/events", 5)
    stats = (await rest("GET", path + "/stats")).json()
    assert [stats["subscriptions"][name]["msgBacklog"] for name in ("a", "b")] == [5, 5]  # no TTL yet

    assert (await rest("POST", f"{V2}/namespaces/{namespace}/messageTTL", 1)).status_code == 204
    assert (await rest("GET", f"{V2}/namespaces/{namespace}/messageTTL")).json() == 1

    async def expired() -> bool:
        subscriptions = (await rest("GET", path + "/stats")).json()["subscriptions"]
        return all(subscriptions[name]["msgBacklog"] == 0 and subscriptions[name]["totalMsgExpired"] == 5 for name in "ab")

    # Checked with the other policies, every 0.5 s on these brokers.
    await wait_until_async(expired, deadline_s=20, poll_s=0.2, what="the messages expiring by TTL")
    assert (await rest("DELETE", f"{V2}/namespaces/{namespace}/messageTTL")).status_code == 204
    await produce(shared_cluster, f"{namespace}/events", 3)
    await trio.sleep(1.5)  # a TTL check would have come (none is set now): the new messages stay
    stats = (await rest("GET", path + "/stats")).json()
    assert [stats["subscriptions"][name]["msgBacklog"] for name in ("a", "b")] == [3, 3]


async def test_hostile_http_closes_only_its_own_connection(shared_cluster):
    import socket

    port = shared_cluster.brokers[0].web_port

    def attack() -> list[bytes]:
        answers = []
        for payload in (b"\x00\xff garbage \r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-Big: " + b"a" * 200_000 + b"\r\n\r\n",
                        b"POST /admin/v2/tenants/t HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc"):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                try:
                    sock.sendall(payload)
                    sock.shutdown(socket.SHUT_WR)
                    answers.append(sock.recv(200))
                except OSError:
                    answers.append(b"")  # closed at once: also fine
        return answers

    answers = await trio.to_thread.run_sync(attack)
    assert all(not answer or answer.startswith(b"HTTP/1.1 4") for answer in answers), answers
    rest = Rest(shared_cluster.brokers[0].web_url)
    assert (await rest("GET", V2 + "/clusters")).json() == ["standalone"]

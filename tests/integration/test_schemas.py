"""Schemas with versions on real brokers (3 bookies, ZooKeeper): the
official Pulsar client's Avro producers and consumers, and the REST API's
/admin/v2/schemas paths, under a namespace's compatibility strategy. A
compatible schema gets a new version, the same one its old version, an
incompatible one is refused with Pulsar's IncompatibleSchema (409 on REST)
and nothing is stored."""

from __future__ import annotations

import json
import uuid

import pulsar
import pytest
import requests
import trio
from pulsar.schema import AvroSchema, Long, Record, String

from tests.integration.broker_processes import shared_cluster  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration

V2 = "/admin/v2"


class UserV1(Record):
    _avro_namespace = "acme"
    id = Long()
    name = String()


class UserV2(Record):
    """Adds a field with a default: FULL-compatible with v1."""

    _avro_namespace = "acme"
    id = Long()
    name = String()
    email = String(required_default=True)  # a union with null, default null


class UserV3(Record):
    """Changes a field's type: compatible with nothing before it."""

    _avro_namespace = "acme"
    id = String()
    name = String()


for kind in (UserV1, UserV2, UserV3):
    kind.__name__ = "User"  # one record name, as one type evolving


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def rest(cluster, method: str, path: str, body=None) -> requests.Response:
    return requests.request(method, cluster.brokers[0].web_url + path, json=body, timeout=30)


async def test_pulsar_producers_and_consumers_evolve_a_schema_within_the_strategy(shared_cluster):
    topic = f"persistent://public/default/{unique('users')}"

    def run() -> tuple[list, str]:
        client = pulsar.Client(shared_cluster.brokers[0].pulsar_url, operation_timeout_seconds=20, io_threads=1,
                               message_listener_threads=1, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
        try:
            first = client.create_producer(topic, schema=AvroSchema(UserV1))
            first.send(UserV1(id=1, name="ann"))
            second = client.create_producer(topic, schema=AvroSchema(UserV2))  # a new version
            second.send(UserV2(id=2, name="bob", email="bob@example.com"))
            again = client.create_producer(topic, schema=AvroSchema(UserV1))  # v1 again: its old version
            again.send(UserV1(id=3, name="cy"))
            try:
                client.create_producer(topic, schema=AvroSchema(UserV3))
                refused = "nothing"
            except Exception as error:  # noqa: BLE001 (which error is what the test checks)
                refused = str(error)
            try:
                client.subscribe(topic, "v3", schema=AvroSchema(UserV3))
                refused_consumer = "nothing"
            except Exception as error:  # noqa: BLE001
                refused_consumer = str(error)
            consumer = client.subscribe(topic, "v2", schema=AvroSchema(UserV2), initial_position=pulsar.InitialPosition.Earliest)
            users = []
            for _ in range(3):
                message = consumer.receive(20_000)
                users.append((message.value().id, message.value().name))
                consumer.acknowledge(message)
            return users, refused, refused_consumer
        finally:
            client.close()

    users, refused, refused_consumer = await trio.to_thread.run_sync(run)
    assert users == [(1, "ann"), (2, "bob"), (3, "cy")]
    assert "IncompatibleSchema" in refused, refused
    assert "IncompatibleSchema" in refused_consumer, refused_consumer
    local = topic.rsplit("/", 1)[1]
    versions = (await trio.to_thread.run_sync(rest, shared_cluster, "GET", f"{V2}/schemas/public/default/{local}/schemas")).json()
    assert [version["version"] for version in versions["getSchemaResponses"]] == [0, 1]
    assert all(version["type"] == "AVRO" for version in versions["getSchemaResponses"])


async def test_the_rest_api_keeps_versions_under_the_namespaces_strategy(shared_cluster):
    def run() -> None:
        tenant = unique("schemas")
        namespace = f"{tenant}/ns"
        assert rest(shared_cluster, "PUT", f"{V2}/tenants/{tenant}", {"allowedClusters": ["standalone"]}).status_code == 204
        assert rest(shared_cluster, "PUT", f"{V2}/namespaces/{namespace}").status_code == 204
        assert rest(shared_cluster, "GET", f"{V2}/namespaces/{namespace}/schemaCompatibilityStrategy").json() == "UNDEFINED"
        assert rest(shared_cluster, "PUT", f"{V2}/namespaces/{namespace}/schemaCompatibilityStrategy", "BACKWARD").status_code == 204
        assert rest(shared_cluster, "GET", f"{V2}/namespaces/{namespace}/schemaCompatibilityStrategy").json() == "BACKWARD"
        assert rest(shared_cluster, "PUT", f"{V2}/persistent/{namespace}/events").status_code == 204
        path = f"{V2}/schemas/{namespace}/events"
        record = lambda *fields: json.dumps({"type": "record", "name": "Event", "fields": list(fields)})  # noqa: E731
        v1 = record({"name": "id", "type": "long"})
        v2 = record({"name": "id", "type": "long"}, {"name": "source", "type": "string", "default": "?"})
        v3 = record({"name": "id", "type": "long"}, {"name": "owner", "type": "string"})  # no default: not BACKWARD

        assert rest(shared_cluster, "GET", path + "/schema").status_code == 404
        assert rest(shared_cluster, "POST", path + "/schema", {"type": "AVRO", "schema": v1}).json() == {"version": {"version": 0}}
        assert rest(shared_cluster, "POST", path + "/schema", {"type": "AVRO", "schema": v1}).json() == {"version": {"version": 0}}
        assert rest(shared_cluster, "POST", path + "/schema", {"type": "AVRO", "schema": v2,
                                                               "properties": {"team": "a"}}).json() == {"version": {"version": 1}}
        check = rest(shared_cluster, "POST", path + "/compatibility", {"type": "AVRO", "schema": v3}).json()
        assert check["isCompatibility"] is False and check["schemaCompatibilityStrategy"] == "BACKWARD"
        refused = rest(shared_cluster, "POST", path + "/schema", {"type": "AVRO", "schema": v3})
        assert refused.status_code == 409 and "owner" in refused.json()["reason"]
        assert rest(shared_cluster, "POST", path + "/schema", {"type": "AVRO", "schema": "{not json"}).status_code == 400
        latest = rest(shared_cluster, "GET", path + "/schema").json()
        assert latest["version"] == 1 and json.loads(latest["data"]) == json.loads(v2) and latest["properties"] == {"team": "a"}
        assert json.loads(rest(shared_cluster, "GET", path + "/schema/0").json()["data"]) == json.loads(v1)
        assert len(rest(shared_cluster, "GET", path + "/schemas").json()["getSchemaResponses"]) == 2
        # Under ALWAYS_COMPATIBLE the same schema is taken.
        assert rest(shared_cluster, "PUT", f"{V2}/namespaces/{namespace}/schemaCompatibilityStrategy",
                    "ALWAYS_COMPATIBLE").status_code == 204

        assert rest(shared_cluster, "POST", path + "/compatibility", {"type": "AVRO", "schema": v3}).json()["isCompatibility"]
        assert rest(shared_cluster, "POST", path + "/schema", {"type": "AVRO", "schema": v3}).json() == {"version": {"version": 2}}
        # Deleted: a version marks it, and a schema given afterwards starts over with the next number.
        assert rest(shared_cluster, "DELETE", path + "/schema").json() == {"version": 3}
        assert rest(shared_cluster, "GET", path + "/schema").status_code == 404
        assert rest(shared_cluster, "GET", path + "/schemas").json() == {"getSchemaResponses": []}
        assert rest(shared_cluster, "POST", path + "/schema", {"type": "AVRO", "schema": v1}).json() == {"version": {"version": 4}}
        assert json.loads(rest(shared_cluster, "GET", path + "/schema/1").json()["data"]) == json.loads(v2)  # kept

    await trio.to_thread.run_sync(run)

"""Topics' schemas with versions, as Pulsar's schema registry keeps them:
every version of a topic's schema in ZooKeeper (broker.topic_store), a new
one taken only when the topic's compatibility strategy allows it
(broker.schema_compatibility), the same one given again getting its old
version. Pulsar's protocol (producers, consumers, GET_SCHEMA) and the REST
API (`/admin/v2/schemas`) both go through here.

A schema is stored as Pulsar's `Schema` message (name, type, definition,
properties), the bytes its clients send.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.errors import BadRequestError, IncompatibleSchemaError, NotFoundError, ServiceUnavailableError
from broker.pulsar.pulsar_api_pb2 import KeyValue, Schema
from broker.schema_compatibility import IncompatibleError, SchemaDefinitionError, Strategy, check
from broker.tenant_store import TenantStore
from broker.topic_records import split_partition
from broker.topic_store import TopicStore

ADD_TRIES_MAX = 5  # versions stored by other brokers meanwhile
SCHEMA_VERSIONS_MAX = 1_000  # versions a topic keeps (each a ZooKeeper node read when a producer connects)
# A version that says "the schema was deleted here": the versions before it
# no longer count, and its number is never given to another schema.
DELETED = b"\x00deleted"
# Pulsar's SchemaType names (its REST API's) of the protocol's Schema.Type values.
REST_NAMES = {"None": "NONE", "String": "STRING", "Json": "JSON", "Protobuf": "PROTOBUF", "Avro": "AVRO", "Bool": "BOOLEAN",
              "Int8": "INT8", "Int16": "INT16", "Int32": "INT32", "Int64": "INT64", "Float": "FLOAT", "Double": "DOUBLE",
              "Date": "DATE", "Time": "TIME", "Timestamp": "TIMESTAMP", "KeyValue": "KEY_VALUE", "Instant": "INSTANT",
              "LocalDate": "LOCAL_DATE", "LocalTime": "LOCAL_TIME", "LocalDateTime": "LOCAL_DATE_TIME",
              "ProtobufNative": "PROTOBUF_NATIVE", "AutoConsume": "AUTO_CONSUME"}
TYPE_NAMES = {Schema.Type.Value(name): rest_name for name, rest_name in REST_NAMES.items() if name in Schema.Type.keys()}
TYPE_VALUES = {rest_name: value for value, rest_name in TYPE_NAMES.items()}


@dataclass(frozen=True)
class StoredSchema:
    version: int
    schema: Schema

    @property
    def type_name(self) -> str:
        return TYPE_NAMES.get(self.schema.type, str(self.schema.type))


def type_value(type_name: str) -> int:
    """Pulsar's schema type, by its name (AVRO, JSON, STRING, ...)."""
    value = TYPE_VALUES.get(str(type_name).upper())
    if value is not None:
        return value
    raise BadRequestError(f"unknown schema type {str(type_name)[:50]!r}: one of {', '.join(sorted(TYPE_NAMES.values()))}")


def make_schema(name: str, type_name: str, definition: bytes, properties: dict[str, str]) -> Schema:
    return Schema(name=name, type=type_value(type_name), schema_data=definition,
                  properties=[KeyValue(key=key, value=value) for key, value in sorted(properties.items())])


def _same(first: Schema, second: Schema) -> bool:
    return (first.type, first.schema_data) == (second.type, second.schema_data)


class SchemaRegistry:
    def __init__(self, topic_store: TopicStore, tenant_store: TenantStore) -> None:
        self.topic_store = topic_store
        self.tenant_store = tenant_store

    async def topic_of(self, name: str) -> str:
        """The topic whose schema a partition (or topic) `name` has."""
        topic, index = split_partition(name)
        if index >= 0 and (await self.topic_store.read_topic(topic)) is not None:
            return topic
        return name

    async def strategy(self, topic: str) -> Strategy:
        """The topic's compatibility strategy: its own, its namespace's, or the broker's default."""
        found = await self.topic_store.read_topic(topic)
        if found is None:
            return Strategy.FULL
        # Read now: a strategy just set applies to the next schema.
        policies = await self.tenant_store.policies_in_effect(topic, found[0], max_age_s=0)
        return Strategy(policies.schema_compatibility_strategy)

    async def _stored(self, topic: str) -> tuple[list[StoredSchema], int | None]:
        """(the versions since the last deletion, the last version number stored, deletions included)."""
        stored = await self.topic_store.schema_versions(topic)
        live: list[StoredSchema] = []
        for version, data in stored:
            if data == DELETED:
                live = []
            else:
                live.append(StoredSchema(version, Schema.FromString(data)))
        return live, stored[-1][0] if stored else None

    async def versions(self, topic: str) -> list[StoredSchema]:
        """The topic's schema versions, oldest first (none before its last deletion)."""
        return (await self._stored(topic))[0]

    async def get(self, topic: str, version: int | None = None) -> StoredSchema:
        """The latest version (or `version`); NotFoundError without one."""
        if version is None:
            live = await self.versions(topic)
            if live:
                return live[-1]
        else:
            found = await self.topic_store.read_schema(topic, version)
            if found is not None and found[0] != DELETED:
                return StoredSchema(version, Schema.FromString(found[0]))
        raise NotFoundError(f"{topic} has no schema" + ("" if version is None else f" of version {version}"))

    async def add(self, topic: str, schema: Schema) -> int:
        """The version of `schema` on the topic: an equal version's, or a new
        one when the topic's strategy takes it (IncompatibleSchemaError otherwise)."""
        for _ in range(ADD_TRIES_MAX):
            versions, last = await self._stored(topic)
            for stored in versions:
                if _same(stored.schema, schema):
                    return stored.version
            self._check(await self.strategy(topic), schema, versions)
            if last is not None and last + 1 >= SCHEMA_VERSIONS_MAX:
                raise BadRequestError(f"{topic} keeps at most {SCHEMA_VERSIONS_MAX} schema versions")
            version = await self.topic_store.add_schema(topic, schema.SerializeToString(), last)
            if version is not None:
                return version
        raise ServiceUnavailableError(f"the schema of {topic} kept changing under {ADD_TRIES_MAX} tries: try again")

    async def check_compatible(self, topic: str, schema: Schema) -> tuple[bool, Strategy, str]:
        """Whether the topic would take `schema` (nothing stored): (yes, the strategy, why not)."""
        versions = await self.versions(topic)
        strategy = await self.strategy(topic)
        if any(_same(stored.schema, schema) for stored in versions):
            return True, strategy, ""
        try:
            self._check(strategy, schema, versions)
        except IncompatibleSchemaError as error:
            return False, strategy, str(error)
        return True, strategy, ""

    async def check_reader(self, topic: str, schema: Schema) -> None:
        """A consumer's schema: one of the versions, or one the strategy
        would take (Pulsar checks a consumer's so; it is not stored)."""
        versions = await self.versions(topic)
        if not versions or any(_same(stored.schema, schema) for stored in versions):
            return
        self._check(await self.strategy(topic), schema, versions)

    @staticmethod
    def _check(strategy: Strategy, schema: Schema, versions: list[StoredSchema]) -> None:
        try:
            check(strategy, TYPE_NAMES.get(schema.type, str(schema.type)), schema.schema_data,
                  [(stored.type_name, stored.schema.schema_data) for stored in versions])
        except IncompatibleError as error:
            raise IncompatibleSchemaError(str(error)) from None
        except SchemaDefinitionError as error:
            raise BadRequestError(f"the schema's definition is not valid: {error}") from None

    async def delete(self, topic: str) -> int:
        """Delete the topic's schema (Pulsar's delete-schema): a version that
        marks it deleted, whose number is returned; NotFoundError without one.
        A schema given afterwards starts over, with the next number."""
        for _ in range(ADD_TRIES_MAX):
            live, last = await self._stored(topic)
            if not live:
                raise NotFoundError(f"{topic} has no schema")
            version = await self.topic_store.add_schema(topic, DELETED, last)
            if version is not None:
                return version
        raise ServiceUnavailableError(f"the schema of {topic} kept changing under {ADD_TRIES_MAX} tries: try again")

    async def forget(self, topic: str) -> None:
        """Every version, with the topic (a topic made again under its name starts without one)."""
        await self.topic_store.delete_schema(topic)


__all__ = ["SchemaRegistry", "StoredSchema", "make_schema", "type_value"]

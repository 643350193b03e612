"""Pulsar's schema compatibility strategies over Avro's resolution rules
(broker/schema_compatibility.py): which evolutions of a record each
strategy takes, and the messages that say why one is refused."""

from __future__ import annotations

import json

import pytest

from broker.schema_compatibility import (
    IncompatibleError,
    SchemaDefinitionError,
    Strategy,
    check,
    parse_avro,
    read_problems,
)


def record(*fields: dict, name: str = "User") -> bytes:
    return json.dumps({"type": "record", "name": name, "namespace": "acme", "fields": list(fields)}).encode()


ID = {"name": "id", "type": "long"}
NAME = {"name": "name", "type": "string"}
EMAIL_DEFAULT = {"name": "email", "type": ["null", "string"], "default": None}
EMAIL_REQUIRED = {"name": "email", "type": "string"}

V1 = record(ID, NAME)
ADDED_WITH_DEFAULT = record(ID, NAME, EMAIL_DEFAULT)
ADDED_WITHOUT_DEFAULT = record(ID, NAME, EMAIL_REQUIRED)
REMOVED_NAME = record(ID)


def allowed(strategy: Strategy, new: bytes, *existing: bytes) -> bool:
    try:
        check(strategy, "AVRO", new, [("AVRO", definition) for definition in existing])
        return True
    except IncompatibleError:
        return False


@pytest.mark.parametrize("new, backward, forward, full", [
    (ADDED_WITH_DEFAULT, True, True, True),  # old readers skip it, new readers default it
    (ADDED_WITHOUT_DEFAULT, False, True, False),  # new readers cannot fill it from old data
    (REMOVED_NAME, True, False, False),  # old readers miss a field without a default
])
def test_each_strategy_takes_the_evolutions_avro_can_resolve(new, backward, forward, full):
    assert allowed(Strategy.BACKWARD, new, V1) is backward
    assert allowed(Strategy.FORWARD, new, V1) is forward
    assert allowed(Strategy.FULL, new, V1) is full
    assert allowed(Strategy.ALWAYS_COMPATIBLE, new, V1)
    assert not allowed(Strategy.ALWAYS_INCOMPATIBLE, new, V1)


def test_transitive_strategies_check_every_version_the_others_only_the_last():
    # v1 -> v2 adds email with a default -> v3 makes it required: BACKWARD
    # from v2 (v2 data has email), not from v1 (no email to read).
    v2 = record(ID, NAME, {"name": "email", "type": "string", "default": ""})
    v3 = record(ID, NAME, EMAIL_REQUIRED)
    assert allowed(Strategy.BACKWARD, v3, V1, v2)
    assert not allowed(Strategy.BACKWARD_TRANSITIVE, v3, V1, v2)


def test_promotions_unions_enums_and_names():
    number = lambda kind: record({"name": "n", "type": kind})  # noqa: E731
    assert read_problems(parse_avro(number("long")), parse_avro(number("int"))) == []  # int widens to long
    assert read_problems(parse_avro(number("int")), parse_avro(number("long")))  # long does not narrow
    assert read_problems(parse_avro(number(["null", "long"])), parse_avro(number("int"))) == []
    assert read_problems(parse_avro(number("long")), parse_avro(number(["null", "int"])))  # null has no reader
    colour = lambda *symbols, **extra: record({"name": "c", "type": {"type": "enum", "name": "Colour", "symbols": list(symbols), **extra}})  # noqa: E731
    assert read_problems(parse_avro(colour("RED", "GREEN")), parse_avro(colour("RED"))) == []
    assert read_problems(parse_avro(colour("RED")), parse_avro(colour("RED", "GREEN")))
    assert read_problems(parse_avro(colour("RED", default="RED")), parse_avro(colour("RED", "GREEN"))) == []
    assert read_problems(parse_avro(record(ID, name="Other")), parse_avro(V1))  # a record of another name
    aliased = record(ID, {"name": "full_name", "type": "string", "aliases": ["name"]})
    assert read_problems(parse_avro(aliased), parse_avro(V1)) == []


def test_recursive_types_resolve():
    node = lambda *extra: json.dumps({"type": "record", "name": "Node", "fields": [  # noqa: E731
        {"name": "value", "type": "int"}, {"name": "next", "type": ["null", "Node"], "default": None}, *extra]}).encode()
    assert allowed(Strategy.FULL, node({"name": "label", "type": "string", "default": ""}), node())


def test_refusals_say_where_and_bad_definitions_are_refused():
    with pytest.raises(IncompatibleError, match="email"):
        check(Strategy.BACKWARD, "AVRO", ADDED_WITHOUT_DEFAULT, [("AVRO", V1)])
    with pytest.raises(IncompatibleError, match="type JSON"):
        check(Strategy.FULL, "AVRO", V1, [("JSON", V1)])
    with pytest.raises(SchemaDefinitionError):
        check(Strategy.FULL, "AVRO", b"{not json", [("AVRO", V1)])
    with pytest.raises(SchemaDefinitionError):
        check(Strategy.FULL, "AVRO", b'{"type": "nonsense"}', [])
    check(Strategy.FULL, "STRING", b"", [("STRING", b"")])  # not Avro: the same type is compatible
    assert Strategy.parse("backward_transitive") is Strategy.BACKWARD_TRANSITIVE
    with pytest.raises(ValueError):
        Strategy.parse("SOMETIMES")


def test_a_type_used_by_many_fields_is_compared_once_and_deep_nesting_is_refused():
    def nested(depth: int, extra: bool) -> bytes:
        # Level i: a record of 8 fields, each of level i-1's type (used, after its definition, by name).
        schema: dict | str = {"type": "record", "name": "L0", "fields": [{"name": "v", "type": "int"}]
                              + ([{"name": "w", "type": "int", "default": 0}] if extra else [])}
        for level in range(1, depth):
            inner = schema
            schema = {"type": "record", "name": f"L{level}", "fields": [
                {"name": f"f{index}", "type": inner if index == 0 else f"L{level - 1}"} for index in range(8)]}
        return json.dumps(schema).encode()

    # Compared field by field, this pair takes 8^8 steps, past the bound
    # (SchemaDefinitionError); each pair of record types compared once, a few hundred.
    assert allowed(Strategy.FULL, nested(8, True), nested(8, False))
    with pytest.raises(SchemaDefinitionError):
        parse_avro(b"[" * 100_000 + b"]" * 100_000)

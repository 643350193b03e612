"""Whether a topic may take a new schema, as Pulsar's schema registry
decides it: the namespace's (or topic's) compatibility strategy, and for
AVRO and JSON schemas (both Avro definitions) Avro's rules of schema
resolution, on schemas parsed by fastavro. Pure: definitions in, problems
out.

BACKWARD: a consumer with the new schema reads what the last one wrote;
FORWARD: a consumer with the last schema reads what the new one writes;
FULL: both. The _TRANSITIVE forms check against every version, not only
the last. Schemas of other types (STRING, PROTOBUF, ...) are compatible
with schemas of the same type.
"""

from __future__ import annotations

import enum
import json
from typing import Any, Iterable


AVRO_TYPE_NAMES = ("AVRO", "JSON")
PROBLEMS_SHOWN_MAX = 5
DEFINITION_BYTES_MAX = 1024 * 1024
RESOLUTION_STEPS_MAX = 100_000  # types compared for one pair of schemas; past it the schema is refused


class Strategy(enum.StrEnum):
    ALWAYS_COMPATIBLE = "ALWAYS_COMPATIBLE"
    ALWAYS_INCOMPATIBLE = "ALWAYS_INCOMPATIBLE"
    BACKWARD = "BACKWARD"
    FORWARD = "FORWARD"
    FULL = "FULL"
    BACKWARD_TRANSITIVE = "BACKWARD_TRANSITIVE"
    FORWARD_TRANSITIVE = "FORWARD_TRANSITIVE"
    FULL_TRANSITIVE = "FULL_TRANSITIVE"

    @classmethod
    def parse(cls, value: Any) -> "Strategy":
        try:
            return cls(str(value).upper())
        except ValueError:
            raise ValueError(f"a schema compatibility strategy is one of {', '.join(cls)}, got {str(value)[:100]!r}") from None


DEFAULT_STRATEGY = Strategy.FULL  # Pulsar's brokers' default (schemaCompatibilityStrategy)


class SchemaDefinitionError(ValueError):
    """A definition that is not an Avro schema."""


class IncompatibleError(ValueError):
    """The new schema breaks the strategy; the message says where."""


def parse_avro(definition: bytes | str) -> dict | list | str:
    """An Avro definition (JSON text) parsed and checked by fastavro."""
    if len(definition) > DEFINITION_BYTES_MAX:
        raise SchemaDefinitionError(f"a schema definition holds at most {DEFINITION_BYTES_MAX} bytes")
    # Imported at the first schema that needs it: some 10 MB of a broker
    # that never sees one.
    import fastavro
    from fastavro.schema import SchemaParseException, UnknownType

    try:
        return fastavro.parse_schema(json.loads(definition))
    except RecursionError:
        raise SchemaDefinitionError("the schema nests too deep") from None
    except (ValueError, TypeError, KeyError, SchemaParseException, UnknownType) as error:
        raise SchemaDefinitionError(f"not an Avro schema: {str(error)[:300]}") from None


PROMOTIONS = {"int": {"long", "float", "double"}, "long": {"float", "double"}, "float": {"double"},
              "string": {"bytes"}, "bytes": {"string"}}
PRIMITIVES = {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}


class _Resolver:
    """Avro's schema resolution of a writer's schema by a reader's."""

    def __init__(self, reader: Any, writer: Any) -> None:
        self.reader_names = _named(reader)
        self.writer_names = _named(writer)
        self.checking: set[tuple[str, str]] = set()  # named pairs being checked (recursive types)
        self.checked: dict[tuple[str, str], bool] = {}  # named pairs checked: a type used by many fields is checked once
        self.problems: list[str] = []
        self.steps = 0

    def _deref(self, schema: Any, names: dict) -> Any:
        if isinstance(schema, str) and schema not in PRIMITIVES:
            return names.get(schema, schema)
        if isinstance(schema, dict) and schema.get("type") in PRIMITIVES and "logicalType" not in schema:
            return schema["type"]
        return schema

    def reads(self, reader: Any, writer: Any, path: str) -> bool:
        self.steps += 1
        if self.steps > RESOLUTION_STEPS_MAX:
            raise SchemaDefinitionError(f"the schemas take more than {RESOLUTION_STEPS_MAX} steps to compare")
        reader, writer = self._deref(reader, self.reader_names), self._deref(writer, self.writer_names)
        if isinstance(writer, list):
            ok = True
            for branch in writer:
                ok = self.reads(reader, branch, path) and ok
            return ok
        if isinstance(reader, list):
            for branch in reader:
                if self._quietly_reads(branch, writer, path):
                    return True
            return self._problem(path, f"no branch of the reader's union reads the writer's {_kind(writer)}")
        reader_kind, writer_kind = _kind(reader), _kind(writer)
        if reader_kind in PRIMITIVES or writer_kind in PRIMITIVES:
            if reader_kind == writer_kind or reader_kind in PROMOTIONS.get(writer_kind, ()):
                return True
            return self._problem(path, f"the writer's {writer_kind} cannot be read as {reader_kind}")
        if reader_kind != writer_kind:
            return self._problem(path, f"the writer's {writer_kind} cannot be read as {reader_kind}")
        if reader_kind in ("record", "enum", "fixed") and _short(reader["name"]) != _short(writer["name"]):
            return self._problem(path, f"{reader_kind} {reader['name']} is named {writer['name']} by the writer")
        if reader_kind == "record":
            pair = (reader["name"], writer["name"])
            if pair in self.checking:
                return True  # a recursive type: the pair is being checked further up
            if pair in self.checked:
                return self.checked[pair] or self._problem(path, f"record {reader['name']} cannot read the writer's (above)")
            self.checking.add(pair)
            try:
                result = self.checked[pair] = self._record(reader, writer, path)
                return result
            finally:
                self.checking.discard(pair)
        if reader_kind == "enum":
            missing = [symbol for symbol in writer["symbols"] if symbol not in reader["symbols"]]
            if missing and "default" not in reader:
                return self._problem(path, f"enum {reader['name']} lacks the writer's symbols {missing[:5]} and has no default")
            return True
        if reader_kind == "fixed":
            if reader["size"] != writer["size"]:
                return self._problem(path, f"fixed {reader['name']} is {reader['size']} bytes, the writer's {writer['size']}")
            return True
        if reader_kind == "array":
            return self.reads(reader["items"], writer["items"], f"{path}[]")
        if reader_kind == "map":
            return self.reads(reader["values"], writer["values"], f"{path}{{}}")
        return self._problem(path, f"unknown type {reader_kind}")

    def _record(self, reader: dict, writer: dict, path: str) -> bool:
        written = {}
        for field in writer["fields"]:
            written[field["name"]] = field
        ok = True
        for field in reader["fields"]:
            names = [field["name"], *field.get("aliases", ())]
            source = next((written[name] for name in names if name in written), None)
            field_path = f"{path}.{field['name']}" if path else field["name"]
            if source is None:
                if "default" not in field:
                    ok = self._problem(field_path, "the reader's field has no default and the writer does not write it")
                continue
            ok = self.reads(field["type"], source["type"], field_path) and ok
        return ok

    def _quietly_reads(self, reader: Any, writer: Any, path: str) -> bool:
        problems, self.problems = self.problems, []
        try:
            return self.reads(reader, writer, path)
        finally:
            self.problems = problems

    def _problem(self, path: str, text: str) -> bool:
        if len(self.problems) <= PROBLEMS_SHOWN_MAX:
            self.problems.append(f"{path or 'the schema'}: {text}")
        return False


def _named(schema: Any) -> dict:
    named = schema.get("__named_schemas", {}) if isinstance(schema, dict) else {}
    if not named and isinstance(schema, list):
        for branch in schema:
            if isinstance(branch, dict):
                named.update(branch.get("__named_schemas", {}))
    return named


def _kind(schema: Any) -> str:
    if isinstance(schema, str):
        return schema
    if isinstance(schema, dict):
        return schema.get("type", "?") if isinstance(schema.get("type"), str) else "?"
    return "union"


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def read_problems(reader: Any, writer: Any) -> list[str]:
    """What keeps data written with `writer` from being read with `reader`
    (both parsed by parse_avro); empty when it can be."""
    resolver = _Resolver(reader, writer)
    resolver.reads(reader, writer, "")
    return resolver.problems


def check(strategy: Strategy, schema_type: str, definition: bytes, existing: Iterable[tuple[str, bytes]]) -> None:
    """Whether a schema (`schema_type` as Pulsar names it, its definition)
    may follow the `existing` (type, definition) versions, oldest first.
    Raises IncompatibleError or SchemaDefinitionError."""
    existing = list(existing)
    if not existing or strategy is Strategy.ALWAYS_COMPATIBLE:
        if schema_type in AVRO_TYPE_NAMES:
            parse_avro(definition)
        return
    if strategy is Strategy.ALWAYS_INCOMPATIBLE:
        raise IncompatibleError("the topic's strategy is ALWAYS_INCOMPATIBLE: it takes no new schema")
    transitive = strategy.value.endswith("_TRANSITIVE")
    against = existing if transitive else existing[-1:]
    base = strategy.value.removesuffix("_TRANSITIVE")
    new = parse_avro(definition) if schema_type in AVRO_TYPE_NAMES else None
    for index, (old_type, old_definition) in enumerate(against):
        version = len(existing) - len(against) + index
        if old_type != schema_type:
            raise IncompatibleError(f"version {version} is of type {old_type}, the new schema of type {schema_type}")
        if new is None:
            continue  # same type, not an Avro definition: compatible (as Pulsar's)
        old = parse_avro(old_definition)
        problems = []
        if base in ("BACKWARD", "FULL"):
            problems += [f"the new schema cannot read version {version}'s data: {problem}" for problem in read_problems(new, old)]
        if base in ("FORWARD", "FULL"):
            problems += [f"version {version} cannot read the new schema's data: {problem}" for problem in read_problems(old, new)]
        if problems:
            shown = "; ".join(problems[:PROBLEMS_SHOWN_MAX])
            raise IncompatibleError(f"incompatible with the topic's schema ({strategy.value}): {shown}"
                                    + ("; and more" if len(problems) > PROBLEMS_SHOWN_MAX else ""))


__all__ = ["DEFAULT_STRATEGY", "IncompatibleError", "SchemaDefinitionError", "Strategy", "check", "parse_avro", "read_problems"]

"""Which partition a keyed message goes to: the key's hash modulo the
number of partitions, with the hashes Pulsar's clients use, so that a key
lands on the same partition whichever client sent it.

  java_string  Java's String.hashCode over the key's UTF-16 code units,
               its sign bit cleared (Pulsar's JavaStringHash, the Java
               client's default)
  murmur3_32   Murmur3 (32 bits, seed 0) of the key's UTF-8 bytes, its top
               bit cleared (Pulsar's Murmur3_32Hash)

The C++ client's default (and so the Python `pulsar-client`'s), BoostHash,
depends on the platform's Boost and is not reproduced, nor is the Go
client's (its JavaStringHash sums the UTF-8 bytes, unsigned): give those
clients a message router with one of these to share partitions with
quire's client.
"""

from __future__ import annotations

import enum

import mmh3


class HashingScheme(str, enum.Enum):
    JAVA_STRING = "java_string"
    MURMUR3_32 = "murmur3_32"

    @classmethod
    def parse(cls, value: "HashingScheme | str") -> "HashingScheme":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown hashing scheme {value!r}; known: {', '.join(scheme.value for scheme in cls)}") from None


def java_string_hash(key: str) -> int:
    """Java's String.hashCode: a signed 32-bit integer."""
    value = 0
    data = key.encode("utf-16-be")
    for index in range(0, len(data), 2):
        value = (31 * value + (data[index] << 8 | data[index + 1])) & 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def murmur3_32_hash(key: str) -> int:
    return mmh3.hash(key.encode(), 0, signed=False) & 0x7FFFFFFF


def partition_for_key(key: str, partitions: int, scheme: HashingScheme = HashingScheme.JAVA_STRING) -> int:
    """Pulsar's `signSafeMod(hash(key), partitions)`, where the Java
    string hash is `hashCode() & Integer.MAX_VALUE`."""
    if partitions < 1:
        raise ValueError(f"a topic has at least one partition, got {partitions}")
    value = java_string_hash(key) & 0x7FFFFFFF if scheme is HashingScheme.JAVA_STRING else murmur3_32_hash(key)
    return value % partitions


__all__ = ["HashingScheme", "java_string_hash", "murmur3_32_hash", "partition_for_key"]

"""Key routing as Pulsar's clients do it: Java's String.hashCode (its sign
bit cleared) or Murmur3, modulo the partitions."""

from __future__ import annotations

import pytest

from broker.client.routing import HashingScheme, java_string_hash, murmur3_32_hash, partition_for_key


def test_the_hashes_are_java_s_and_murmur3_s():
    assert java_string_hash("hello") == 99162322  # "hello".hashCode()
    assert java_string_hash("😀") == 1772899  # a surrogate pair: two UTF-16 code units
    assert java_string_hash("polygenelubricants") == -(2**31)  # Integer.MIN_VALUE
    assert murmur3_32_hash("hello") == 613153351


def test_a_negative_java_hash_loses_its_sign_bit_before_the_modulo():
    # JavaStringHash.makeHash is hashCode() & Integer.MAX_VALUE: MIN_VALUE becomes 0.
    assert partition_for_key("polygenelubricants", 3) == 0
    negative = next(key for key in (f"account-{index}" for index in range(100)) if java_string_hash(key) < 0)
    assert partition_for_key(negative, 3) == (java_string_hash(negative) & 0x7FFFFFFF) % 3


@pytest.mark.parametrize("scheme", list(HashingScheme))
def test_every_key_lands_on_a_partition(scheme):
    assert {partition_for_key(f"k{index}", 4, scheme) for index in range(200)} == {0, 1, 2, 3}
    with pytest.raises(ValueError):
        partition_for_key("k", 0, scheme)

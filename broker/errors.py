"""The errors a broker answers and a broker client raises, in one small
hierarchy: each maps to one status on the wire, so that a client can tell
"retry elsewhere" (the topic moved) from "retry later" from "give up"."""

from __future__ import annotations

import enum


class BrokerStatus(enum.IntEnum):
    OK = 0
    ERROR = 1  # the broker failed (a bookie or ZooKeeper error): retry may help
    BAD_REQUEST = 2  # the request is not valid (a bug of the client)
    NOT_OWNER = 3  # this broker does not serve the topic (any more): look it up again
    TOPIC_NOT_FOUND = 4
    TOPIC_EXISTS = 5
    PRODUCER_BUSY = 6  # another producer with this producer id is connected
    CONSUMER_BUSY = 7  # exclusive subscription already has a consumer / type mismatch
    DUPLICATE = 8  # the message's sequence id was persisted before: dropped
    RETRY = 9  # a message with this sequence id is still being written: ask again
    PARTITION_OVERFLOW = 10  # backlog quota exceeded: publish refused until space is freed
    SUBSCRIPTION_NOT_FOUND = 11
    TOPIC_FENCED = 12  # the topic's owner changed or its storage failed: reconnect
    SERVICE_UNAVAILABLE = 13  # no broker can take the topic now
    BAD_VERSION = 14  # protocol versions differ
    CHECKSUM = 15  # a message's checksum did not match: corrupted on the way
    NOT_ALLOWED = 16  # something quire does not do (transactions, non-persistent topics, ...)
    PRODUCER_FENCED = 17  # an exclusive producer took the partition: this producer may not publish there
    UNAUTHENTICATED = 18  # no credentials where the broker needs them, or credentials it refused
    UNAUTHORIZED = 19  # the client's role may not do this
    NOT_FOUND = 20  # no such tenant or namespace
    CONFLICT = 21  # the tenant or namespace exists, or is not empty


class BrokerError(Exception):
    """Base of every error of the broker and its client."""

    status = BrokerStatus.ERROR


class BadRequestError(BrokerError):
    status = BrokerStatus.BAD_REQUEST


class PreconditionFailedError(BadRequestError):
    """The request is well formed, but what it names is not in a state
    that allows it (a cluster that does not exist, partitions not above
    zero): HTTP 412 on the web API, BAD_REQUEST on the wire."""


class MalformedBatchError(BadRequestError):
    """A producer's batch that cannot be stored faithfully: its declared
    codec, count, keys or sequence ids do not match its body, or the body
    does not decode. Refused before anything is stored. On the wire it is a
    BAD_REQUEST (a client gets a `BadRequestError` saying "malformed batch:
    ..."): a bug of the producer, which a resend cannot mend."""


class ChecksumMismatchError(BadRequestError):
    """A producer's message whose CRC32C does not match its bytes: refused
    (Pulsar's ChecksumError), nothing stored; the producer may resend it."""

    status = BrokerStatus.CHECKSUM


class NotAllowedError(BrokerError):
    """A request for something quire does not do: refused with the reason."""

    status = BrokerStatus.NOT_ALLOWED


class AuthenticationError(BrokerError):
    """Credentials missing where the broker needs them, or refused (expired,
    wrongly signed, malformed): the connection is refused."""

    status = BrokerStatus.UNAUTHENTICATED


class AuthorizationError(BrokerError):
    """The client's role may not do what it asked: nothing changed."""

    status = BrokerStatus.UNAUTHORIZED


class NotFoundError(BrokerError):
    """No such tenant or namespace."""

    status = BrokerStatus.NOT_FOUND


class ConflictError(BrokerError):
    """A tenant or namespace that exists already, or that still holds
    namespaces or topics and so cannot be deleted."""

    status = BrokerStatus.CONFLICT


class IncompatibleSchemaError(ConflictError):
    """A schema the topic's compatibility strategy refuses (Pulsar's
    IncompatibleSchema; HTTP 409 on the web API)."""


class NotOwnerError(BrokerError):
    status = BrokerStatus.NOT_OWNER


class TopicNotFoundError(BrokerError):
    status = BrokerStatus.TOPIC_NOT_FOUND


class TopicExistsError(BrokerError):
    status = BrokerStatus.TOPIC_EXISTS


class ProducerBusyError(BrokerError):
    status = BrokerStatus.PRODUCER_BUSY


class ProducerFencedError(BrokerError):
    """A producer fenced out by an exclusive one (Pulsar's ProducerFenced):
    it is closed, and refused until that one goes."""

    status = BrokerStatus.PRODUCER_FENCED


class ConsumerBusyError(BrokerError):
    status = BrokerStatus.CONSUMER_BUSY


class DuplicateMessageError(BrokerError):
    """Not an error to a producer: its message was persisted before."""

    status = BrokerStatus.DUPLICATE


class RetryLaterError(BrokerError):
    status = BrokerStatus.RETRY


class PartitionOverflowError(BrokerError):
    """The partition holds more than its backlog quota: a producer is refused
    until subscriptions acknowledge and retention frees space."""

    status = BrokerStatus.PARTITION_OVERFLOW


class SubscriptionNotFoundError(BrokerError):
    status = BrokerStatus.SUBSCRIPTION_NOT_FOUND


class TopicFencedError(BrokerError):
    """The topic was taken over by another broker, or its storage failed and
    it was unloaded: clients look it up again."""

    status = BrokerStatus.TOPIC_FENCED


class ServiceUnavailableError(BrokerError):
    status = BrokerStatus.SERVICE_UNAVAILABLE


class ProtocolVersionError(BrokerError):
    status = BrokerStatus.BAD_VERSION


class ConnectionClosedError(BrokerError):
    """The connection to a broker broke (the client reconnects)."""


class ClientClosedError(BrokerError):
    """The producer, consumer or client was closed."""


_BY_STATUS = {
    cls.status: cls
    for cls in (
        BrokerError,
        BadRequestError,
        NotOwnerError,
        TopicNotFoundError,
        TopicExistsError,
        ProducerBusyError,
        ConsumerBusyError,
        DuplicateMessageError,
        RetryLaterError,
        PartitionOverflowError,
        SubscriptionNotFoundError,
        TopicFencedError,
        ServiceUnavailableError,
        ProtocolVersionError,
        ChecksumMismatchError,
        NotAllowedError,
        ProducerFencedError,
        AuthenticationError,
        AuthorizationError,
        NotFoundError,
        ConflictError,
    )
}


def error_for_status(status: BrokerStatus, message: str) -> BrokerError:
    return _BY_STATUS.get(status, BrokerError)(message)


__all__ = [
    "AuthenticationError",
    "AuthorizationError",
    "BadRequestError",
    "BrokerError",
    "BrokerStatus",
    "IncompatibleSchemaError",
    "PreconditionFailedError",
    "ChecksumMismatchError",
    "ClientClosedError",
    "ConflictError",
    "ConnectionClosedError",
    "ConsumerBusyError",
    "DuplicateMessageError",
    "MalformedBatchError",
    "NotFoundError",
    "NotAllowedError",
    "NotOwnerError",
    "PartitionOverflowError",
    "ProducerBusyError",
    "ProducerFencedError",
    "ProtocolVersionError",
    "RetryLaterError",
    "ServiceUnavailableError",
    "SubscriptionNotFoundError",
    "TopicExistsError",
    "TopicFencedError",
    "TopicNotFoundError",
    "error_for_status",
]

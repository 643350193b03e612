"""The broker client (trio): producers, consumers, readers and admin calls.
`broker.client.sync.Client` offers the same for code that is not async."""

from broker.client.client import Client
from broker.client.consumer import Consumer, ConsumerOptions, DeadLetterPolicy
from broker.client.messages import Message, MessageId, SendResult
from broker.client.producer import Producer, ProducerOptions, SendFuture
from broker.client.routing import HashingScheme, partition_for_key
from broker.dispatcher import SubscriptionType
from broker.errors import (
    BrokerError,
    ClientClosedError,
    ConsumerBusyError,
    PartitionOverflowError,
    ProducerBusyError,
    TopicExistsError,
    TopicNotFoundError,
)
from broker.codecs import Codec

__all__ = [
    "BrokerError",
    "Client",
    "ClientClosedError",
    "Codec",
    "Consumer",
    "ConsumerBusyError",
    "ConsumerOptions",
    "DeadLetterPolicy",
    "HashingScheme",
    "Message",
    "MessageId",
    "PartitionOverflowError",
    "Producer",
    "ProducerBusyError",
    "ProducerOptions",
    "SendFuture",
    "SendResult",
    "SubscriptionType",
    "TopicExistsError",
    "TopicNotFoundError",
    "partition_for_key",
]

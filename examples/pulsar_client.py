"""The official Apache Pulsar client (`pip install pulsar-client`) against a
quire cluster: a batching, LZ4-compressing producer sends 100 keyed
messages with properties, a Shared consumer from the earliest position
receives and acknowledges them, and a reader reads the topic from
MessageId.earliest. See docs/operations.md, "Using Pulsar clients".

    quire cluster up --data-dir /tmp/quire          # prints "Pulsar clients: pulsar://127.0.0.1:6650"
    python examples/pulsar_client.py --service-url pulsar://127.0.0.1:6650 --topic orders

The quire topic `orders` is `persistent://public/default/orders` to Pulsar
clients; a topic named for the first time is created, not partitioned.
Against a secured cluster (`quire cluster up --secure`), add the token and
the CA that signed the brokers' certificates:

    python examples/pulsar_client.py --service-url pulsar+ssl://127.0.0.1:6651 \
        --token-file /tmp/quire/security/admin.token --tls-trust-certs-file /tmp/quire/security/ca.cert.pem
"""

import argparse
import time
import uuid

import pulsar

COUNT = 100
RECEIVE_TIMEOUT_MS = 10_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--service-url", default="pulsar://127.0.0.1:6650", help="default %(default)s")
    parser.add_argument("--topic", default="orders", help="a quire topic name or a full Pulsar one (default %(default)s)")
    parser.add_argument("--listener-name", help="the brokers' listener to use (docker-compose from the host: external)")
    parser.add_argument("--token-file", help="a file holding the token to authenticate with (Pulsar's token authentication)")
    parser.add_argument("--tls-trust-certs-file", help="the CA certificates that signed the brokers' (for pulsar+ssl://)")
    arguments = parser.parse_args()
    security = {}
    if arguments.token_file:
        with open(arguments.token_file) as file:
            security["authentication"] = pulsar.AuthenticationToken(file.read().strip())
    if arguments.tls_trust_certs_file:
        security["tls_trust_certs_file_path"] = arguments.tls_trust_certs_file
    topic = arguments.topic if "://" in arguments.topic else f"persistent://public/default/{arguments.topic}"
    run = uuid.uuid4().hex[:8]  # this run's messages, among what the topic already holds

    client = pulsar.Client(arguments.service_url, listener_name=arguments.listener_name, operation_timeout_seconds=30,
                           logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error), **security)
    try:
        # Subscribe first: the subscription exists before the messages are sent.
        consumer = client.subscribe(topic, "pulsar-example", consumer_type=pulsar.ConsumerType.Shared,
                                    initial_position=pulsar.InitialPosition.Earliest)
        producer = client.create_producer(topic, batching_enabled=True, batching_max_publish_delay_ms=10,
                                          compression_type=pulsar.CompressionType.LZ4, block_if_queue_full=True)
        failures = []
        for number in range(COUNT):
            producer.send_async(f"order {number}".encode(),
                                lambda result, _id: failures.append(result) if result != pulsar.Result.Ok else None,
                                partition_key=f"account-{number % 10}",
                                properties={"run": run, "kind": "debit" if number % 2 else "credit"})
        producer.flush()
        if failures:
            raise SystemExit(f"{len(failures)} sends failed: {failures[0]}")
        print(f"producer {producer.producer_name()}: sent {COUNT} messages to {topic} (keys account-0..9, batched, LZ4)")

        # The subscription may hold older messages too (from earlier runs or
        # other producers): everything received is acknowledged.
        ours, others, keys = 0, 0, set()
        deadline = time.monotonic() + 60
        while ours < COUNT and time.monotonic() < deadline:
            try:
                message = consumer.receive(RECEIVE_TIMEOUT_MS)
            except pulsar.Timeout:
                break
            if message.properties().get("run") == run:
                ours += 1
                keys.add(message.partition_key())
            else:
                others += 1
            consumer.acknowledge(message)
        print(f"consumer (Shared, subscription pulsar-example): received and acknowledged {ours} of them"
              f" ({len(keys)} keys)" + (f", and {others} messages the topic held before" if others else ""))
        if ours < COUNT:
            raise SystemExit(f"only {ours} of {COUNT} messages came")

        reader = client.create_reader(topic, pulsar.MessageId.earliest)
        read, read_ours, first = 0, 0, None
        while reader.has_message_available():
            message = reader.read_next(RECEIVE_TIMEOUT_MS)
            if first is None:
                first = message
            read += 1
            read_ours += message.properties().get("run") == run
        print(f"reader from MessageId.earliest: read {read} messages ({read_ours} of this run); "
              f"the first: {first.data()[:40]!r}, id {first.message_id()}, published {first.publish_timestamp()} ms")
        for closable in (reader, consumer, producer):
            closable.close()
    finally:
        client.close()


if __name__ == "__main__":
    main()

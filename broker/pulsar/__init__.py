"""Apache Pulsar's binary protocol, spoken by quire's brokers on
`--pulsar-port`: the protobuf messages (`pulsar_api_pb2`, generated from
`pulsar_api.proto`), the framing (`wire`), and the front-end that turns
Pulsar commands into the broker's own calls (`server`)."""

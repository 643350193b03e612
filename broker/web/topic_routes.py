"""Pulsar's `/admin/v2/persistent` paths (topics, partitions, stats,
subscriptions, unload, compaction) and HTTP lookup (`/lookup/v2/topic/persistent`).

What is about one partition's live state is answered by the broker that
serves it: any other broker answers 307 with the owner's URL, as Pulsar's
do. What is about a partitioned topic is asked of each partition's owner
(here, or by HTTP with the caller's credentials) and put together.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import httpx
import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from broker.errors import (
    AuthenticationError,
    AuthorizationError,
    BadRequestError,
    BrokerError,
    ConflictError,
    NotAllowedError,
    NotFoundError,
    PreconditionFailedError,
    ServiceUnavailableError,
    TopicNotFoundError,
)
from broker.ownership_core import Access
from broker.topic_lookup import lookup_partition, partition_count
from broker.topic_names import pulsar_name, quire_name
from broker.topic_records import TopicRecord, partition_name, split_partition
from broker.web.endpoints import endpoint, int_parameter, no_content, query_flag, read_body, read_json
from broker.web.pulsar_json import compaction_status_json, internal_stats, partitioned_stats, topic_stats

V2 = "/admin/v2"
TOPIC = V2 + "/persistent/{tenant}/{namespace}/{topic}"
SUBSCRIPTION = TOPIC + "/subscription/{subscription}"
LATEST = 2**63 - 1  # Pulsar's MessageId.latest is (Long.MAX_VALUE, Long.MAX_VALUE)
PARTITION_CALLS_IN_FLIGHT_MAX = 16  # a partitioned topic's partitions asked at once
# A request relayed to a partition's owner says how many times it was: an
# owner changing meanwhile cannot send it round for ever.
RELAY_HEADER = "x-quire-relayed"
RELAY_HOPS_MAX = 3


def topic_of_request(request: Request) -> str:
    """The quire name of the topic (or partition) the path names."""
    params = request.path_params
    return quire_name(f"persistent://{params['tenant']}/{params['namespace']}/{params['topic']}")


def _namespace(request: Request) -> str:
    return f"{request.path_params['tenant']}/{request.path_params['namespace']}"


async def _admin(web: Any, action: str, arguments: dict, role: str | None) -> dict:
    return await web.server.admin.handle(action, arguments, role)


async def _record(web: Any, topic: str) -> TopicRecord | None:
    found = await web.server.topic_store.read_topic(topic)
    return None if found is None else found[0]


async def _partitions_of(web: Any, name: str) -> tuple[TopicRecord | None, list[str]]:
    """(the topic's record, its partitions) of a topic or a partition's
    name (None for a partition of a partitioned topic, or a partition this
    broker serves); TopicNotFoundError when neither exists."""
    if web.server.hosting.core.access(name) is Access.SERVE:
        return None, [name]  # served here: a partition, and it exists (no ZooKeeper read)
    record = await _record(web, name)
    if record is not None:
        return record, record.partition_names(name)
    topic, index = split_partition(name)
    if index >= 0:
        parent = await _record(web, topic)
        if parent is not None and index < parent.partitions:
            return None, [name]
    raise TopicNotFoundError(f"topic {pulsar_name(name)} does not exist")


async def _on_owner(web: Any, request: Request, partition: str, local: Callable[[], Awaitable[Any]]) -> Any:
    """`local()` here if this broker serves the partition; otherwise the
    request is relayed to the broker that does (with authority when that
    broker is to take it), and its answer is this one."""
    info, redirect = await web.server.lookup(partition, query_flag(request, "authoritative"))
    if info.broker_id == web.server.info.broker_id:
        return await local()
    answer = await _ask_owner(web, request, info, redirect, request.scope["path"], dict(request.query_params),
                              await read_body(request))
    return _relayed(answer)


async def _ask_owner(web: Any, request: Request, info: Any, authoritative: bool, path: str, query: dict,
                     body: bytes) -> Any:
    """The answer of another broker's web service to the request's method
    on `path`, with the caller's credentials. Pulsar's brokers answer 307
    with the owner's URL instead; relaying lets a client that reaches one
    broker (through a published port, say) reach every partition."""
    hops = int_parameter(request.headers.get(RELAY_HEADER), RELAY_HEADER, default=0, minimum=0)
    if hops >= RELAY_HOPS_MAX:
        raise ServiceUnavailableError(f"the partition's owner is changing (relayed {hops} times): try again")
    headers = {RELAY_HEADER: str(hops + 1)}
    for name in ("authorization", "content-type"):
        if name in request.headers:
            headers[name] = request.headers[name]
    if authoritative:
        query = {**query, "authoritative": "true"}
    # Over TLS when the caller came over TLS (its token stays encrypted), if the owner has it.
    tls = request.url.scheme == "https"
    url = info.web_url_for(None, tls=tls) or info.web_url_for(None, tls=not tls)
    if url is None:
        raise NotAllowedError(f"broker {info.broker_id} serves the partition and has no web service")
    try:
        return await web.client.request(request.method, url + path, params=query, headers=headers, content=body)
    except httpx.HTTPError as error:
        raise ServiceUnavailableError(f"broker {info.broker_id}, which serves the partition, did not answer: {error}") from None


def _relayed(answer: Any) -> Response:
    return Response(answer.content, status_code=answer.status_code, media_type=answer.headers.get("content-type"))


def _partition_path(partition: str, suffix: str) -> str:
    return f"{V2}/persistent/{pulsar_name(partition)[len('persistent://'):]}{suffix}"


async def _each_partition(web: Any, request: Request, partitions: list[str], role: str | None, suffix: str,
                          local: Callable[[str], Awaitable[Any]]) -> dict[str, Any]:
    """Each partition's answer, by partition: `local(partition)` for those
    this broker serves; for each other one, its owner's answer to the
    request's method on the partition's path and `suffix`, with the
    request's query and body. The first failure fails the whole."""
    answers: dict[str, Any] = {}
    slots = trio.Semaphore(PARTITION_CALLS_IN_FLIGHT_MAX)
    body = await read_body(request)

    async def one(partition: str) -> None:
        async with slots:
            info, redirect = await web.server.lookup(partition, False)
            if info.broker_id == web.server.info.broker_id:
                answers[partition] = await local(partition)
                return
            answer = await _ask_owner(web, request, info, redirect, _partition_path(partition, suffix),
                                      dict(request.query_params), body)
            if answer.status_code >= 400:
                raise _remote_error(answer, partition)
            answers[partition] = answer.json() if answer.content else None

    async with trio.open_nursery() as nursery:
        for partition in partitions:
            nursery.start_soon(one, partition)
    return {partition: answers[partition] for partition in partitions}


# Another broker's answer, as the error it stands for.
ERROR_BY_STATUS: dict[int, type[BrokerError]] = {
    400: BadRequestError, 401: AuthenticationError, 403: AuthorizationError, 404: NotFoundError, 406: BadRequestError,
    409: ConflictError, 412: PreconditionFailedError, 501: NotAllowedError, 503: ServiceUnavailableError,
}


def _remote_error(answer: Any, partition: str) -> BrokerError:
    try:
        reason = str(answer.json().get("reason", ""))
    except (ValueError, AttributeError):
        reason = answer.text[:500]
    return ERROR_BY_STATUS.get(answer.status_code, BrokerError)(f"{pulsar_name(partition)}: {reason[:1000]}")


# --- topics ------------------------------------------------------------------------------------


@endpoint
async def list_topics(web: Any, request: Request, role: str | None) -> Response:
    """Every persistent topic of the namespace: the non-partitioned ones and each partition."""
    from broker.topic_lookup import topics_of_namespace

    return JSONResponse(await topics_of_namespace(web.server, _namespace(request), role))


@endpoint
async def list_partitioned_topics(web: Any, request: Request, role: str | None) -> Response:
    namespace = _namespace(request)
    answer = await _admin(web, "list_topics", {"namespace": namespace}, role)
    return JSONResponse(sorted(pulsar_name(topic["topic"]) for topic in answer["topics"] if topic["partitions"] > 0))


async def _create(web: Any, request: Request, role: str | None, partitions: int) -> Response:
    topic = topic_of_request(request)
    _, index = split_partition(topic)
    if index >= 0 and await _record(web, split_partition(topic)[0]) is not None:
        raise PreconditionFailedError(f"{pulsar_name(topic)} is a partition of a partitioned topic")
    await _admin(web, "create_topic", {"topic": topic, "partitions": partitions}, role)
    return no_content()


@endpoint
async def create_partitioned_topic(web: Any, request: Request, role: str | None) -> Response:
    partitions = await read_json(request)
    if type(partitions) is not int:
        raise BadRequestError("the body is the number of partitions")
    if partitions < 1:
        return JSONResponse({"reason": "Number of partitions should be more than 0"}, status_code=406)
    return await _create(web, request, role, partitions)


@endpoint
async def create_topic(web: Any, request: Request, role: str | None) -> Response:
    return await _create(web, request, role, 0)


@endpoint
async def update_partitions(web: Any, request: Request, role: str | None) -> Response:
    raise NotAllowedError("quire does not change a topic's number of partitions: create a new topic")


@endpoint
async def get_partitions(web: Any, request: Request, role: str | None) -> Response:
    """A topic's partitions (0: not partitioned), as Pulsar clients ask
    before producing or consuming over HTTP; with checkAllowAutoCreation a
    topic named for the first time is made (when the broker makes topics)."""
    create = query_flag(request, "checkAllowAutoCreation")
    try:
        partitions = await partition_count(web.server, topic_of_request(request), role, create=create)
    except TopicNotFoundError:
        partitions = 0  # as Pulsar: a topic that does not exist is not partitioned
    return JSONResponse({"partitions": partitions})


async def _delete_one(web: Any, request: Request, role: str | None, partition: str, force: bool) -> Any:
    """Delete a partition this broker serves, and its topic's record if it is not partitioned."""
    await _admin(web, "delete_partition", {"partition": partition, "force": force}, role)
    record = await _record(web, partition)
    if record is not None and record.partitions == 0:
        await _admin(web, "delete_topic_record", {"topic": partition}, role)
    return None


@endpoint
async def delete_topic(web: Any, request: Request, role: str | None) -> Response:
    topic, force = topic_of_request(request), query_flag(request, "force")
    record, partitions = await _partitions_of(web, topic)
    if record is not None and record.partitions > 0:
        raise PreconditionFailedError(f"{pulsar_name(topic)} is partitioned: delete it with DELETE .../partitions")

    async def run() -> Response:
        await _delete_one(web, request, role, topic, force)
        return no_content()

    return await _on_owner(web, request, topic_of_request(request), run)


@endpoint
async def delete_partitioned_topic(web: Any, request: Request, role: str | None) -> Response:
    topic, force = topic_of_request(request), query_flag(request, "force")
    record = await _record(web, topic)
    if record is None or record.partitions == 0:
        raise TopicNotFoundError(f"partitioned topic {pulsar_name(topic)} does not exist")
    await web.server.access.check_topic_admin(role, topic, "delete")
    await _each_partition(web, request, record.partition_names(topic), role, "",
                          local=lambda partition: _delete_one(web, request, role, partition, force))
    await _admin(web, "delete_topic_record", {"topic": topic}, role)
    return no_content()


# --- stats ---------------------------------------------------------------------------------------


async def _stats(web: Any, partition: str, role: str | None) -> dict:
    return await _admin(web, "partition_stats", {"partition": partition}, role)


@endpoint
async def get_stats(web: Any, request: Request, role: str | None) -> Response:
    topic = topic_of_request(request)
    record, _ = await _partitions_of(web, topic)
    if record is not None and record.partitions > 0:
        raise TopicNotFoundError(f"{pulsar_name(topic)} is partitioned: its stats are at .../partitioned-stats")

    async def run() -> Response:
        return JSONResponse(topic_stats(await _stats(web, topic, role)))

    return await _on_owner(web, request, topic_of_request(request), run)


@endpoint
async def get_internal_stats(web: Any, request: Request, role: str | None) -> Response:
    topic = topic_of_request(request)
    await _partitions_of(web, topic)

    async def run() -> Response:
        return JSONResponse(internal_stats(await _stats(web, topic, role)))

    return await _on_owner(web, request, topic_of_request(request), run)


async def _partitioned(web: Any, topic: str) -> TopicRecord:
    record = await _record(web, topic)
    if record is None or record.partitions == 0:
        raise TopicNotFoundError(f"partitioned topic {pulsar_name(topic)} does not exist")
    return record


async def _each_partition_view(web: Any, request: Request, role: str | None, suffix: str,
                               shape: Callable[[dict], dict]) -> tuple[TopicRecord, dict[str, dict]]:
    """A partitioned topic's record, and each partition's description in
    `shape` (as the partition's own `suffix` path answers it)."""
    topic = topic_of_request(request)
    record = await _partitioned(web, topic)

    async def local(partition: str) -> dict:
        return shape(await _stats(web, partition, role))

    return record, await _each_partition(web, request, record.partition_names(topic), role, suffix, local=local)


@endpoint
async def get_partitioned_stats(web: Any, request: Request, role: str | None) -> Response:
    _, answers = await _each_partition_view(web, request, role, "/stats", topic_stats)
    return JSONResponse(partitioned_stats(answers, per_partition=query_flag(request, "perPartition", True)))


@endpoint
async def get_partitioned_internal_stats(web: Any, request: Request, role: str | None) -> Response:
    record, answers = await _each_partition_view(web, request, role, "/internalStats", internal_stats)
    return JSONResponse({"metadata": {"partitions": record.partitions},
                         "partitions": {pulsar_name(name): stats for name, stats in answers.items()}})


# --- partition operations: one partition here or at its owner, a partitioned topic's each --------


def _suffix(request: Request) -> str:
    """What the path holds after the topic's name (`/stats`, `/subscription/S/skip/3`)."""
    params = request.path_params
    prefix = f"{V2}/persistent/{params['tenant']}/{params['namespace']}/{params['topic']}"
    path = request.scope["path"]
    assert path.startswith(prefix), (path, prefix)
    return path[len(prefix):]


async def _fan_out(web: Any, request: Request, role: str | None, action: str, arguments: dict) -> list[Any]:
    """Run admin `action` on the topic's partition, or on each partition of
    a partitioned topic (the others' owners are asked the request's method
    and path, for each partition); the answers, one per partition."""
    topic = topic_of_request(request)
    record, partitions = await _partitions_of(web, topic)
    suffix = _suffix(request)

    async def local(partition: str) -> Any:
        return await _admin(web, action, {**arguments, "partition": partition}, role)

    if record is not None and record.partitions > 0:
        answers = await _each_partition(web, request, partitions, role, suffix, local=local)
        return list(answers.values())

    async def run() -> list[Any]:
        return [await local(topic)]

    return await _on_owner(web, request, topic, run)


@endpoint
async def list_subscriptions(web: Any, request: Request, role: str | None) -> Response:
    topic = topic_of_request(request)
    record, partitions = await _partitions_of(web, topic)

    async def local(partition: str) -> list[str]:
        return sorted((await _stats(web, partition, role))["subscriptions"])

    if record is not None and record.partitions > 0:
        answers = await _each_partition(web, request, partitions, role, "/subscriptions", local=local)
        return JSONResponse(sorted({name for names in answers.values() for name in names}))

    async def run() -> Response:
        return JSONResponse(await local(topic))

    return await _on_owner(web, request, topic, run)


def _message_position(body: Any) -> Any:
    """Pulsar's MessageId body as a subscription's start: "latest",
    "earliest" or [ledger id, entry id, batch index]."""
    if body is None:
        return "latest"
    if not isinstance(body, dict) or type(body.get("ledgerId")) is not int or type(body.get("entryId")) is not int:
        raise BadRequestError("a message id is {\"ledgerId\": L, \"entryId\": E}")
    ledger_id, entry_id = body["ledgerId"], body["entryId"]
    if ledger_id == LATEST and entry_id == LATEST:
        return "latest"
    if ledger_id == -1 and entry_id == -1:
        return "earliest"
    batch_index = body.get("batchIndex", -1)
    if type(batch_index) is not int:
        raise BadRequestError("batchIndex must be an integer")
    return [ledger_id, entry_id, max(batch_index, 0)]


def _subscription_arguments(request: Request) -> dict:
    return {"subscription": request.path_params["subscription"]}


@endpoint
async def create_subscription(web: Any, request: Request, role: str | None) -> Response:
    if query_flag(request, "replicated"):
        raise NotAllowedError("quire does not replicate subscriptions between clusters")
    body = await read_json(request, default=None)
    arguments = {**_subscription_arguments(request), "position": _message_position(body)}
    await _fan_out(web, request, role, "create_subscription", arguments)
    return no_content()


@endpoint
async def delete_subscription(web: Any, request: Request, role: str | None) -> Response:
    arguments = {**_subscription_arguments(request), "force": query_flag(request, "force")}
    await _fan_out(web, request, role, "delete_subscription", arguments)
    return no_content()


def _partition_call(action: str, **parameters: tuple[str, str]):
    """An endpoint running admin `action` on the topic's partitions (on the
    subscription the path names, if it names one); each of `parameters`
    maps an argument to (the path parameter holding it, what it is), an
    integer of 0 or more."""

    @endpoint
    async def call(web: Any, request: Request, role: str | None) -> Response:
        arguments = _subscription_arguments(request) if "subscription" in request.path_params else {}
        for argument, (parameter, what) in parameters.items():
            arguments[argument] = int_parameter(request.path_params[parameter], what, minimum=0)
        await _fan_out(web, request, role, action, arguments)
        return no_content()

    return call


@endpoint
async def compaction_status(web: Any, request: Request, role: str | None) -> Response:
    return JSONResponse(compaction_status_json(await _fan_out(web, request, role, "compaction_status", {})))


@endpoint
async def reset_cursor_to_message(web: Any, request: Request, role: str | None) -> Response:
    body = await read_json(request)
    position = _message_position(body)
    if not isinstance(position, list):
        raise BadRequestError("reset a cursor to a message id, or to a time with .../resetcursor/TIMESTAMP")
    topic = topic_of_request(request)
    record, partitions = await _partitions_of(web, topic)
    if record is not None and record.partitions > 0:
        index = body.get("partitionIndex", -1)
        if type(index) is not int or not 0 <= index < record.partitions:
            raise BadRequestError(f"a message id of partitioned topic {pulsar_name(topic)} names its partitionIndex")
        topic = partition_name(topic, index)
    excluded = body.get("isExcluded", False)
    if type(excluded) is not bool:
        raise BadRequestError("isExcluded is true or false")
    arguments = {**_subscription_arguments(request), "message_id": position, "partition": topic, "excluded": excluded}

    async def run() -> Response:
        await _admin(web, "reset_cursor", arguments, role)
        return no_content()

    return await _on_owner(web, request, topic, run)


# --- HTTP lookup ----------------------------------------------------------------------------------


@endpoint
async def lookup(web: Any, request: Request, role: str | None) -> Response:
    """Pulsar's LookupData for a partition: the broker that serves it, or
    that one's answer when it is to take the partition (asked with authority)."""
    topic = topic_of_request(request)
    listener = request.query_params.get("listenerName") or request.headers.get("x-pulsar-listener-name") or None
    info, redirect = await lookup_partition(web.server, topic, role, authoritative=query_flag(request, "authoritative"))
    if redirect:
        answer = await _ask_owner(web, request, info, True, request.scope["path"], dict(request.query_params), b"")
        return _relayed(answer)
    # Every field is there, "" for a listener the broker lacks: Pulsar's
    # C++ client refuses an answer without one of them.
    data = {}
    for field, scheme, tls in (("brokerUrl", "pulsar", False), ("brokerUrlTls", "pulsar+ssl", True)):
        address = info.pulsar_address_for(listener, tls=tls)
        data[field] = "" if address is None else f"{scheme}://{address}"
    if not data["brokerUrl"] and not data["brokerUrlTls"]:
        raise NotAllowedError(f"broker {info.broker_id} serves {pulsar_name(topic)} and has no Pulsar listener"
                              + (f" named {listener[:100]!r}" if listener else ""))
    for field, tls in (("httpUrl", False), ("httpUrlTls", True)):
        data[field] = info.web_url_for(listener, tls=tls) or ""
    data["nativeUrl"] = data["brokerUrl"]
    return JSONResponse(data)


EXPIRY = ("seconds", "expireTimeInSeconds")


def topic_routes() -> list[tuple[str, str, Any]]:
    persistent = V2 + "/persistent/{tenant}/{namespace}"
    return [
        ("GET", persistent, list_topics),
        ("GET", persistent + "/partitioned", list_partitioned_topics),
        ("PUT", TOPIC, create_topic),
        ("DELETE", TOPIC, delete_topic),
        ("PUT", TOPIC + "/partitions", create_partitioned_topic),
        ("POST", TOPIC + "/partitions", update_partitions),
        ("GET", TOPIC + "/partitions", get_partitions),
        ("DELETE", TOPIC + "/partitions", delete_partitioned_topic),
        ("GET", TOPIC + "/stats", get_stats),
        ("GET", TOPIC + "/internalStats", get_internal_stats),
        ("GET", TOPIC + "/partitioned-stats", get_partitioned_stats),
        ("GET", TOPIC + "/partitioned-internalStats", get_partitioned_internal_stats),
        ("PUT", TOPIC + "/unload", _partition_call("unload")),
        ("PUT", TOPIC + "/compaction", _partition_call("compact")),
        ("GET", TOPIC + "/compaction", compaction_status),
        ("GET", TOPIC + "/subscriptions", list_subscriptions),
        ("PUT", SUBSCRIPTION, create_subscription),
        ("DELETE", SUBSCRIPTION, delete_subscription),
        ("POST", SUBSCRIPTION + "/skip/{count}", _partition_call("skip_messages", count=("count", "the number of messages"))),
        ("POST", SUBSCRIPTION + "/skip_all", _partition_call("skip_messages")),
        ("POST", SUBSCRIPTION + "/expireMessages/{seconds}", _partition_call("expire_messages", seconds=EXPIRY)),
        ("POST", TOPIC + "/all_subscription/expireMessages/{seconds}", _partition_call("expire_messages", seconds=EXPIRY)),
        ("POST", SUBSCRIPTION + "/resetcursor/{timestamp}",
         _partition_call("reset_cursor", publish_time_ms=("timestamp", "the timestamp"))),
        ("POST", SUBSCRIPTION + "/resetcursor", reset_cursor_to_message),
        ("GET", "/lookup/v2/topic/persistent/{tenant}/{namespace}/{topic}", lookup),
    ]


__all__ = ["topic_routes"]

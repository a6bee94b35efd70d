"""RabbitMQ native delays: the 28-level TTL topology, quorum queues driven by a binary routing key.

A delay of d seconds is written as 28 bits, most significant first, followed by the destination:
`0.0.....1.0.1.orders`. Level n is a topic exchange that routes a message whose bit n is 1 into a
quorum queue with a TTL of 2^n s, and one whose bit n is 0 straight on to level n-1; an expired
message is dead-lettered (at least once) to level n-1 as well. Level 0 ends in the delivery
exchange, where every endpoint queue is bound on exactly 28 one-word bits and its own name
(`*.*. … .*.<endpoint>`), so `cancel` does not also catch `orders.cancel`. The delivery exchange
has an alternate exchange: a message for a destination with no binding lands in the `unroutable`
queue instead of being dropped. Endpoint queues dead-letter a message redelivered more than
`delivery_limit` times to the `poison` queue.

Publishing uses publisher confirms with many messages in flight (a window), so a batch is fast
and every message is known to be queued, returned (no such queue) or nacked (the broker cannot
take it now: an outage, never the message's fault).
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import ssl
import struct
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from itertools import takewhile
from typing import Any

import pika
import pika.data
import pika.frame
import pika.spec
from pika.exceptions import (
    AMQPConnectionError,
    AMQPError,
    ChannelClosedByBroker,
    ChannelWrongStateError,
    NackError,
    UnroutableError,
)

from airflow_delay_provider.core.delays import seconds_until, whole_seconds
from airflow_delay_provider.core.errors import (
    DelayError,
    DelayProviderError,
    DestinationNotFoundError,
    InvalidInputError,
    InvalidNameError,
    UnavailableError,
)
from airflow_delay_provider.core.message import HEADER_DUE_AT, DelayedMessage, check_destination
from airflow_delay_provider.core.ports import HeldMessage, ReceivedMessage, Transport

log = logging.getLogger(__name__)

LEVELS = 28
MAX_DELAY_SECONDS = 2**LEVELS - 1  # 268,435,455 s, about 8.5 years
DELAY_HEADER = "x-delay-seconds"
#: Headers the broker or the delay mechanics add; receivers never see them.
STRIPPED_HEADERS = frozenset(
    {DELAY_HEADER, HEADER_DUE_AT, "x-delivery-count", "x-death", "x-first-death-queue", "x-first-death-reason",
     "x-first-death-exchange", "x-last-death-queue", "x-last-death-reason", "x-last-death-exchange"}
)
#: Routing keys are at most 255 bytes; the delay bits take 2 bytes per level.
MAX_ROUTING_KEY_BYTES = 255
#: Redeliveries an endpoint queue allows before a message goes to poison: RabbitMQ 4.x's own default
#: (3.x has no limit), set explicitly so every broker version behaves alike and nothing is dropped.
DELIVERY_LIMIT = 20


def max_delay(levels: int = LEVELS) -> int:
    return 2**levels - 1


def routing_key(delay_seconds: int | float, destination: str, levels: int = LEVELS) -> str:
    """`b(levels-1). … .b0.destination`: the delay in binary, most significant bit first.

    Fractions round up, negative delays mean 0; a delay above 2^levels - 1 raises DelayError.
    """
    delay = whole_seconds(delay_seconds, negative_is_now=True)
    if delay > max_delay(levels):
        raise DelayError(
            f"cannot delay a message by {delay} s: it exceeds the maximum delay value of {max_delay(levels)} s "
            f"({levels} levels, about {max_delay(levels) / 31_557_600:.1f} years)"
        )
    return ".".join(format(delay, f"0{levels}b")) + "." + destination


def first_level(delay_seconds: int) -> int:
    """The level a delayed message enters at: its highest set bit (0 when there is none)."""
    return max(0, int(delay_seconds).bit_length() - 1)


def naming_rule(levels: int = LEVELS) -> str:
    return (
        "a RabbitMQ destination is one or more words separated by single dots, since it travels as the tail of "
        "a topic routing key; a word is any characters (Unicode too) but no '*' or '#' (topic wildcards), and none "
        "is empty (no leading, trailing or doubled dot); names starting with 'amq.' are reserved by RabbitMQ; "
        f"at most {MAX_ROUTING_KEY_BYTES - 2 * levels} bytes in UTF-8 with {levels} delay levels"
    )


def check_endpoint(name: object, levels: int = LEVELS) -> str:
    """An endpoint (queue) name that is safe as the tail of a topic routing key."""
    name = check_destination(name)
    size = len(name.encode())
    if "" in name.split("."):
        problem = "it has an empty word"
    elif "*" in name or "#" in name:
        problem = "it contains a topic wildcard ('*' or '#')"
    elif name.startswith("amq."):
        problem = "the 'amq.' prefix is reserved"
    elif size > MAX_ROUTING_KEY_BYTES - 2 * levels:
        problem = f"it takes {size} bytes"
    else:
        return name
    raise InvalidNameError(f"RabbitMQ destination {name!r} cannot be routed, {problem}: {naming_rule(levels)}")


# -- the topology, as data --------------------------------------------------------------------
@dataclass(frozen=True)
class Exchange:
    name: str
    type: str
    arguments: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Queue:
    name: str
    arguments: dict = field(default_factory=dict)
    #: Arguments an earlier version declared this queue with: such a queue is kept (arguments
    #: cannot change in place) and reported as outdated instead of failing the declaration.
    legacy_arguments: dict | None = None


@dataclass(frozen=True)
class Binding:
    source: str
    destination: str
    destination_type: str  # "queue" or "exchange"
    routing_key: str


@dataclass(frozen=True)
class Topology:
    exchanges: tuple[Exchange, ...]
    queues: tuple[Queue, ...]
    bindings: tuple[Binding, ...]
    #: Bindings of earlier versions, removed once `bindings` are in place.
    retired: tuple[Binding, ...] = ()


QUORUM = {"x-queue-type": "quorum"}


class Names:
    """Every name of the delay infrastructure under one prefix."""

    def __init__(self, prefix: str = "delay", levels: int = LEVELS) -> None:
        if isinstance(levels, bool) or not isinstance(levels, int) or not 1 <= levels <= LEVELS:
            raise InvalidNameError(f"levels must be an int in 1..{LEVELS}, got {levels!r}")
        try:
            check_endpoint(f"{prefix}.level-00")
        except InvalidInputError as exc:
            raise InvalidNameError(f"prefix {prefix!r} cannot name the delay exchanges and queues: {exc}") from None
        self.prefix = prefix
        self.levels = levels
        self.delivery = f"{prefix}.delivery"
        self.unroutable = f"{prefix}.unroutable"
        self.poison = f"{prefix}.poison"

    def level(self, n: int) -> str:
        return f"{self.prefix}.level-{n:02d}"


def delay_topology(names: Names) -> Topology:
    """The TTL levels and their bindings, the delivery exchange, the unroutable safety net and poison.

    Level queues get no delivery limit: their dead-letter exchange is the next level (for TTL
    expiry), so a message redelivered past a limit would move on early instead of reaching poison.
    """
    exchanges, queues, bindings = [], [], []
    top = names.levels - 1
    for n in range(top, -1, -1):
        level = names.level(n)
        onward = names.level(n - 1) if n else names.delivery
        exchanges.append(Exchange(level, "topic"))
        queues.append(
            Queue(
                level,
                {
                    **QUORUM,
                    "x-message-ttl": 2**n * 1000,
                    "x-dead-letter-exchange": onward,
                    "x-dead-letter-strategy": "at-least-once",
                    "x-overflow": "reject-publish",
                },
            )
        )
        skip = "*." * (top - n)
        bindings.append(Binding(level, level, "queue", skip + "1.#"))
        bindings.append(Binding(level, onward, "exchange", skip + "0.#"))
    exchanges.append(Exchange(names.delivery, "topic", {"alternate-exchange": names.unroutable}))
    exchanges.append(Exchange(names.unroutable, "fanout"))
    queues.append(Queue(names.unroutable, dict(QUORUM)))
    queues.append(Queue(names.poison, dict(QUORUM)))
    bindings.append(Binding(names.unroutable, names.unroutable, "queue", ""))
    return Topology(tuple(exchanges), tuple(queues), tuple(bindings))


def endpoint_binding_key(names: Names, endpoint: str) -> str:
    """Exactly `levels` one-word bits and the endpoint: `cancel` does not match `<bits>.orders.cancel`."""
    return "*." * names.levels + endpoint


def endpoint_arguments(names: Names, delivery_limit: int) -> dict:
    """A quorum queue that dead-letters a message redelivered more than `delivery_limit` times to
    poison, at least once (which needs reject-publish), through the default exchange."""
    return {
        **QUORUM,
        "x-delivery-limit": delivery_limit,
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": names.poison,
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
    }


def endpoint_topology(names: Names, endpoint: str, delivery_limit: int = DELIVERY_LIMIT) -> Topology:
    check_endpoint(endpoint, names.levels)
    return Topology(
        (),
        (Queue(endpoint, endpoint_arguments(names, delivery_limit), legacy_arguments=dict(QUORUM)),),
        (Binding(names.delivery, endpoint, "queue", endpoint_binding_key(names, endpoint)),),
        # `#.<endpoint>` also matched `<bits>.orders.<endpoint>`; every key in flight has exactly
        # `levels` bits, so the exact binding, added first, takes all of them over.
        retired=(Binding(names.delivery, endpoint, "queue", f"#.{endpoint}"),),
    )


def delivery_limit_policy(names: Names, vhost: str, queues: Sequence[str], delivery_limit: int) -> str:
    """The rabbitmqctl command giving outdated endpoint queues what their arguments lack."""
    pattern = "^(" + "|".join(re.escape(q) for q in queues) + ")$"
    definition = {
        "delivery-limit": delivery_limit,
        "dead-letter-exchange": "",
        "dead-letter-routing-key": names.poison,
        "dead-letter-strategy": "at-least-once",
        "overflow": "reject-publish",
    }
    return shlex.join(["rabbitmqctl", "set_policy", "-p", vhost, f"{names.prefix}.delivery-limit", pattern,
                       json.dumps(definition), "--apply-to", "queues"])


# -- the transport ------------------------------------------------------------------------------
def _flag(value: Any) -> bool:
    """Extras from URI-style connections arrive as strings."""
    return value is True or str(value).lower() in ("true", "1", "yes")


#: The integer connection extras: their default and allowed range.
_INT_EXTRAS = {"heartbeat": (60, 0, None), "levels": (LEVELS, 1, LEVELS), "confirm_window": (1000, 1, None),
               "delivery_limit": (DELIVERY_LIMIT, 1, None)}


def _int_extra(spec: dict, name: str) -> int:
    """An integer extra (a string from URI-style connections); the error names the extra and its range."""
    default, low, high = _INT_EXTRAS[name]
    value = spec.get(name, default)
    try:
        n = value if type(value) is int else int(value) if isinstance(value, str) else None
    except ValueError:
        n = None
    if n is None or n < low or (high is not None and n > high):
        allowed = f"in {low}..{high}" if high is not None else f">= {low}"
        raise InvalidInputError(f"the rabbitmq connection extra {name} must be an int {allowed}, got {value!r}")
    return n


def parameters_from_spec(spec: dict) -> tuple[pika.ConnectionParameters, dict]:
    """pika parameters and transport options from a connection spec (see hooks.rabbitmq.connection_spec)."""
    heartbeat, levels, window, delivery_limit = (
        _int_extra(spec, name) for name in ("heartbeat", "levels", "confirm_window", "delivery_limit"))
    tls = None
    if _flag(spec.get("tls", False)):
        context = ssl.create_default_context()
        if not _flag(spec.get("tls_verify", True)):
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        tls = pika.SSLOptions(context, spec.get("host"))
    params = pika.ConnectionParameters(
        host=spec.get("host") or "127.0.0.1",
        port=int(spec.get("port") or (5671 if tls else 5672)),
        virtual_host=spec.get("virtual_host") or "/",
        credentials=pika.PlainCredentials(spec.get("login") or "guest", spec.get("password") or "guest"),
        heartbeat=heartbeat,
        ssl_options=tls,
        connection_attempts=1,
        blocked_connection_timeout=30,
    )
    options = {"prefix": spec.get("prefix") or "delay", "levels": levels, "confirm_window": window,
               "delivery_limit": delivery_limit}
    return params, options


class RabbitMQTransport(Transport):
    """Delivers each message at its due time: due now straight to its queue, later through the levels."""

    name = "rabbitmq"

    def __init__(
        self,
        parameters: pika.ConnectionParameters,
        prefix: str = "delay",
        levels: int = LEVELS,
        confirm_window: int = 1000,
        confirm_timeout: float = 30.0,
        delivery_limit: int = DELIVERY_LIMIT,
    ) -> None:
        if isinstance(delivery_limit, bool) or not isinstance(delivery_limit, int) or delivery_limit < 1:
            # RabbitMQ 4.x reads -1 as "no limit", 3.x as "drop at the first redelivery": neither is allowed.
            raise InvalidInputError(f"delivery_limit must be an int >= 1, got {delivery_limit!r}")
        if isinstance(confirm_window, bool) or not isinstance(confirm_window, int) or confirm_window < 1:
            # 0 would publish nothing and time every send out
            raise InvalidInputError(f"confirm_window must be an int >= 1, got {confirm_window!r}")
        self.parameters = parameters
        self.names = Names(prefix, levels)
        self.delivery_limit = delivery_limit
        self.confirm_window = confirm_window
        self.confirm_timeout = confirm_timeout
        self._publisher: ConfirmingPublisher | None = None
        self._retired: list[ConfirmingPublisher] = []  # stuck ones still finishing the batches they have
        self._admin: pika.BlockingConnection | None = None
        self._consumer = None  # the channel receive() and ack() share: delivery tags belong to it
        self._holder = None  # the channel holding messages taken from the levels, until they are settled
        self._levels_declared = False

    @classmethod
    def from_spec(cls, spec: dict) -> RabbitMQTransport:
        """A transport from a connection spec (plain data), in a process without Airflow."""
        params, options = parameters_from_spec(spec)
        return cls(params, **options)

    def __repr__(self) -> str:
        p = self.parameters
        return f"RabbitMQTransport(amqp://{p.host}:{p.port}/{p.virtual_host}, prefix={self.names.prefix!r})"

    @property
    def where(self) -> str:
        p = self.parameters
        return f"RabbitMQ at {p.host}:{p.port} (vhost {p.virtual_host!r})"

    # -- connections -----------------------------------------------------------------------------
    def _channel(self):
        """A fresh channel on the admin connection, reconnecting once if the broker dropped it."""
        for attempt in (1, 2):
            if self._admin is None or self._admin.is_closed:
                try:
                    self._admin = pika.BlockingConnection(self.parameters)
                except AMQPError as exc:
                    raise UnavailableError(f"could not connect to {self.where}: {_describe(exc)}") from None
            try:
                return self._admin.channel()
            except AMQPConnectionError:
                self._admin = self._consumer = None
                if attempt == 2:
                    raise UnavailableError(f"the connection to {self.where} keeps closing") from None

    def close(self) -> None:
        for conn in (self._admin, self._publisher, *self._retired):
            try:
                if conn is not None and not conn.is_closed:
                    conn.close()
            except AMQPError:
                pass  # already going away: nothing left to release
        self._admin = self._publisher = self._consumer = self._holder = None
        self._retired = []

    # -- provisioning ------------------------------------------------------------------------------
    def declare(self, topology: Topology) -> dict:
        """Declare everything in `topology`; a queue an earlier version declared is kept as it is and
        listed under `outdated` (with what its arguments lack)."""
        outdated: dict[str, str] = {}
        channel = self._channel()
        try:
            for ex in topology.exchanges:
                channel.exchange_declare(ex.name, ex.type, durable=True, arguments=ex.arguments or None)
            for q in topology.queues:
                try:
                    channel.queue_declare(q.name, durable=True, arguments=q.arguments or None)
                except ChannelClosedByBroker as exc:
                    if q.legacy_arguments is None or exc.reply_code != 406:
                        raise
                    channel = self._channel()  # the refusal closed the channel
                    self._declare_legacy(channel, q, exc)
                    outdated[q.name] = ", ".join(sorted(set(q.arguments) - set(q.legacy_arguments)))
            for b in topology.bindings:
                if b.destination_type == "queue":
                    channel.queue_bind(b.destination, b.source, routing_key=b.routing_key)
                else:
                    channel.exchange_bind(b.destination, b.source, routing_key=b.routing_key)
            for b in topology.retired:
                channel.queue_unbind(b.destination, b.source, routing_key=b.routing_key)  # a no-op when absent
        except ChannelClosedByBroker as exc:
            raise InvalidNameError(
                f"{self.where} refused the delay topology ({exc.reply_code} {exc.reply_text}); something with the same "
                "name exists with other arguments (for an endpoint queue, perhaps another delivery_limit): run the "
                "provision task with verify=True to see what differs"
            ) from None
        finally:
            if channel.is_open:
                channel.close()
        return {
            "exchanges": [e.name for e in topology.exchanges],
            "queues": [q.name for q in topology.queues],
            "bindings": len(topology.bindings),
            "outdated": outdated,
        }

    def _declare_legacy(self, channel, queue: Queue, refusal: ChannelClosedByBroker) -> None:
        """Accept `queue` as an earlier version declared it; otherwise re-raise the first refusal,
        which names the argument that differs."""
        try:
            channel.queue_declare(queue.name, durable=True, arguments=queue.legacy_arguments)
        except ChannelClosedByBroker:
            raise refusal from None

    def check_endpoint(self, endpoint: str, **options: Any) -> str:
        return check_endpoint(endpoint, self.names.levels)

    def provision(self, endpoint: str) -> dict:
        """Declare the endpoint's queue and binding, and (once per transport) the delay levels.

        An endpoint of an earlier version is brought up to date where RabbitMQ allows it: its
        `#.<endpoint>` binding is replaced, after the exact one is in place; its queue, declared
        without a delivery limit, is kept and reported under `outdated` (verify() gives the policy
        that adds the limit)."""
        topology = endpoint_topology(self.names, endpoint, self.delivery_limit)
        if not self._levels_declared:
            self.declare(delay_topology(self.names))
            self._levels_declared = True
        declared = self.declare(topology)
        result = {"transport": self.name, "endpoint": endpoint, "levels": self.names.levels,
                  "queue": endpoint, "binding": topology.bindings[0].routing_key, "delivery_limit": self.delivery_limit}
        if declared["outdated"]:
            result["delivery_limit"] = None
            result["outdated"] = f"queue declared by an earlier version without {declared['outdated'][endpoint]}"
            log.warning("RabbitMQ queue %r on %s was declared by an earlier version without %s: a message redelivered "
                        "over and over never reaches %s (RabbitMQ 3.x redelivers it forever, 4.x drops it after 20); "
                        "verify gives the policy that adds them", endpoint, self.where, declared["outdated"][endpoint],
                        self.names.poison)
        return result

    def teardown(self, endpoint: str) -> dict:
        """Delete an endpoint's queue. Its delayed messages still in the levels land in `unroutable`."""
        check_endpoint(endpoint, self.names.levels)
        channel = self._channel()
        try:
            channel.queue_unbind(endpoint, self.names.delivery, routing_key=endpoint_binding_key(self.names, endpoint))
            deleted = channel.queue_delete(endpoint).method.message_count
        finally:
            if channel.is_open:
                channel.close()
        return {"endpoint": endpoint, "deleted_messages": deleted}

    def verify(self, endpoints: Iterable[str] = ()) -> dict:
        """Report what is missing or declared with other arguments, changing nothing.

        An endpoint queue an earlier version declared (no delivery limit) still works: it is listed
        under `outdated`, not `different`, and `outdated_fix` is the rabbitmqctl command whose policy
        adds what it lacks (policies are not visible over AMQP, so it stays listed after that).
        Bindings cannot be listed over AMQP, so they are not checked here (provisioning re-binds)."""
        topology = delay_topology(self.names)
        queues = list(topology.queues) + [endpoint_topology(self.names, e, self.delivery_limit).queues[0]
                                          for e in endpoints]
        report: dict[str, Any] = {"missing": [], "different": [], "outdated": [], "ok": []}
        for ex in topology.exchanges:
            self._check(report, ex.name, lambda ch, ex=ex: ch.exchange_declare(ex.name, passive=True),
                        lambda ch, ex=ex: ch.exchange_declare(ex.name, ex.type, durable=True,
                                                              arguments=ex.arguments or None))
        for q in queues:
            legacy = None if q.legacy_arguments is None else (
                lambda ch, q=q: ch.queue_declare(q.name, durable=True, arguments=q.legacy_arguments))
            self._check(report, q.name, lambda ch, q=q: ch.queue_declare(q.name, passive=True),
                        lambda ch, q=q: ch.queue_declare(q.name, durable=True, arguments=q.arguments or None), legacy)
        outdated = [o["name"] for o in report["outdated"]]
        report["outdated_fix"] = (delivery_limit_policy(self.names, self.parameters.virtual_host, outdated,
                                                        self.delivery_limit) if outdated else None)
        report["unroutable_depth"] = (None if self.names.unroutable in report["missing"]
                                      else self.depth(self.names.unroutable)["visible"])
        report["complete"] = not report["missing"] and not report["different"]
        return report

    def _check(self, report: dict, name: str, exists, equivalent, legacy=None) -> None:
        channel = self._channel()
        try:
            exists(channel)
        except ChannelClosedByBroker:
            report["missing"].append(name)
            return
        try:
            equivalent(channel)  # it exists: declaring it again changes nothing, or fails when it differs
            report["ok"].append(name)
        except ChannelClosedByBroker as exc:
            if legacy is not None:
                channel = self._channel()
                try:
                    legacy(channel)
                    report["outdated"].append({"name": name, "broker_says": exc.reply_text})
                    return
                except ChannelClosedByBroker:
                    pass  # neither current nor earlier arguments: really different
            report["different"].append({"name": name, "broker_says": exc.reply_text})
        finally:
            if channel.is_open:
                channel.close()

    def depth(self, queue: str) -> dict[str, int]:
        """Messages ready in the queue (`visible`); RabbitMQ does not count unacknowledged ones over AMQP."""
        check_endpoint(queue, self.names.levels)  # a name that cannot exist says why, not "no such queue"
        channel = self._channel()
        try:
            return {"visible": channel.queue_declare(queue, passive=True).method.message_count}
        except ChannelClosedByBroker as exc:
            raise DestinationNotFoundError(
                f"queue {queue!r} does not exist on {self.where}: {exc.reply_text}") from None
        except AMQPConnectionError as exc:
            self._admin = self._consumer = None
            raise UnavailableError(f"lost the connection to {self.where}: {_describe(exc)}") from None
        finally:
            if channel.is_open:
                channel.close()

    # -- sending ------------------------------------------------------------------------------------
    pipelined = True

    def send(self, messages: Sequence[DelayedMessage], connection: Any = None) -> dict[str, Exception]:
        return self.send_start(messages, connection)()

    def send_start(self, messages: Sequence[DelayedMessage], connection: Any = None):
        """Publish a batch without waiting: the returned function waits for its confirms and gives the failures.

        Each message's remaining delay is its due time minus now on `clock()`: the store's, on which due times
        are kept, once the pump or the send operator gave it (use_clock), not this host's."""
        now = self.clock()
        failures: dict[str, Exception] = {}
        publishes = []
        bad_names: dict[str, Exception | None] = {}
        for m in messages:
            if m.destination not in bad_names:  # each name checked once per batch
                try:
                    bad_names[m.destination] = check_endpoint(m.destination, self.names.levels) and None
                except InvalidNameError as exc:
                    bad_names[m.destination] = exc
            try:
                if bad_names[m.destination] is not None:
                    raise bad_names[m.destination]
                publishes.append(self._publication(m, now))
            except (DelayError, InvalidNameError) as exc:
                failures[m.message_id] = exc
        if not publishes:
            return lambda: failures
        publisher = self._open_publisher()
        batch = publisher.start(publishes)

        def wait() -> dict[str, Exception]:
            failures.update(publisher.wait(batch))
            return failures

        return wait

    def _open_publisher(self) -> ConfirmingPublisher:
        """The publisher to start a batch on: a new one when the last is broken or has been idle too long."""
        self._retired = [p for p in self._retired if not p.is_closed]
        current = self._publisher
        if current is not None and (not current.is_open or current.stale(self.parameters.heartbeat)):
            # Idle past half the heartbeat: nothing ran the I/O loop to answer the broker's heartbeats, so it
            # may have dropped the connection; a fresh one costs milliseconds, finding out costs a failed
            # batch and a breaker's wait. A stuck one still waits for the batches it has, then closes itself.
            if current.busy:
                self._retired.append(current)
            else:
                current.close()
            current = self._publisher = None
        if current is None:
            current = self._publisher = ConfirmingPublisher(self.parameters, self.confirm_window, self.confirm_timeout)
        return current

    def _publication(self, m: DelayedMessage, now: datetime) -> Publication:
        delay = seconds_until(m.due_at, now)
        headers = {**m.headers, HEADER_DUE_AT: m.due_at.isoformat()}
        if delay:
            headers[DELAY_HEADER] = delay
        if delay == 0:
            # Due now: straight to the queue through the default exchange; `mandatory` makes a
            # missing queue come back as a return, so the pump can dead-letter it at once.
            return Publication(m.message_id, "", m.destination, m.body, headers)
        key = routing_key(delay, m.destination, self.names.levels)
        return Publication(m.message_id, self.names.level(first_level(delay)), key, m.body, headers)

    # -- receiving ----------------------------------------------------------------------------------
    def receive(self, endpoint: str, max_messages: int = 10, visibility_timeout: float = 30.0) -> list[ReceivedMessage]:
        """Basic.get up to `max_messages`; unacked messages go back to the queue when the channel closes
        (RabbitMQ has no visibility timeout: `visibility_timeout` is ignored)."""
        check_endpoint(endpoint, self.names.levels)
        for _attempt in (1, 2):
            if self._consumer is None or self._consumer.is_closed:
                self._consumer = self._channel()
            received, now = [], self.clock()
            try:
                for _ in range(max_messages):
                    method, properties, body = self._consumer.basic_get(endpoint, auto_ack=False)
                    if method is None:
                        break
                    received.append(_received(endpoint, method, properties, body, now))
                return received
            except ChannelClosedByBroker as exc:
                self._consumer = None
                raise DestinationNotFoundError(
                    f"cannot receive from {endpoint!r} on {self.where}: {exc.reply_text}") from None
            except AMQPConnectionError:
                # The broker requeues what the lost channel held unacked: receiving again is safe.
                self._admin = self._consumer = None
        raise UnavailableError(f"the connection to {self.where} keeps closing while receiving from {endpoint!r}")

    def ack(self, endpoint: str, receipts: Iterable[Any]) -> int:
        count = 0
        for tag in receipts:
            self._consumer.basic_ack(tag)
            count += 1
        return count

    def release(self, endpoint: str, receipts: Iterable[Any]) -> int:
        """Return received, unacked messages to their queue (basic.nack with requeue). RabbitMQ before 4.3
        counts that, as any return, toward the queue's delivery limit (see peek)."""
        count = 0
        try:
            for tag in receipts:
                if self._consumer is None or not self._consumer.is_open:
                    break  # their channel closed: the broker has returned them already
                self._consumer.basic_nack(tag, requeue=True)
                count += 1
        except AMQPError:
            self._consumer = None  # a channel that fails here is gone: the broker returns what it held
        return count

    def peek(self, endpoint: str, max_messages: int = 10) -> list[ReceivedMessage]:
        """Refused: AMQP shows a message only by delivering it, and a quorum queue counts every return
        toward its delivery limit, so peeking could move a message to poison."""
        raise NotImplementedError(
            f"cannot peek at RabbitMQ queue {endpoint!r}: AMQP shows a message only by delivering it, and a quorum "
            "queue counts its return (basic.nack or basic.reject with requeue, or its channel closing) toward "
            f"x-delivery-limit ({self.delivery_limit}) on RabbitMQ 3.x and 4.0-4.2, so looking at a message more "
            f"than {self.delivery_limit} times would move it to {self.names.poison!r}; redrive by destination or by "
            "message ids instead, which moves what it selects back to the store")

    # -- taking back (a migration to the store) ----------------------------------------------------
    can_take_back = True

    def take_held(self, max_messages: int) -> list[HeldMessage]:
        """Basic.get up to `max_messages` from the delay levels, level 27 down to 0 (a message expiring
        meanwhile drops to a lower level, read later). A message without a message id or a due-time
        header comes as None (poison). They stay unacknowledged on one channel until settled; if it
        closes first, the broker puts them back in their levels."""
        held: list[HeldMessage] = []
        try:
            if self._holder is None or not self._holder.is_open:
                self._holder = self._channel()
                self._holder.confirm_delivery()  # a poison publish returns only once the poison queue has it
            channel = self._holder
            for n in range(self.names.levels - 1, -1, -1):
                while len(held) < max_messages:
                    method, properties, body = channel.basic_get(self.names.level(n), auto_ack=False)
                    if method is None:
                        break
                    message = self._stored_form(method.routing_key, properties, body)
                    held.append(HeldMessage(message, _HeldReceipt(channel, method.delivery_tag, properties, body)))
        except ChannelClosedByBroker as exc:
            self._holder = None
            raise DestinationNotFoundError(f"cannot read the delay levels on {self.where}: {exc.reply_text}") from None
        except AMQPConnectionError as exc:
            self._admin = self._consumer = self._holder = None
            raise UnavailableError(f"lost the connection to {self.where} while reading the delay levels "
                                   f"(the broker puts back what was taken): {_describe(exc)}") from None
        return held

    def ack_held(self, receipts: Iterable[Any]) -> int:
        channel, taken = self._holding(receipts)
        try:
            for r in taken:
                channel.basic_ack(r.tag)
        except AMQPError as exc:
            self._drop_holder()
            raise UnavailableError(f"could not acknowledge taken messages on {self.where} (the broker puts "
                                   f"back the unacknowledged ones): {_describe(exc)}") from None
        return len(taken)

    def poison_held(self, receipts: Iterable[Any]) -> int:
        """Publish each to `<prefix>.poison` as it was, then acknowledge it: the ack waits for the confirm."""
        channel, taken = self._holding(receipts)
        try:
            for r in taken:
                channel.basic_publish("", self.names.poison, r.body, r.properties, mandatory=True)
                channel.basic_ack(r.tag)
        except UnroutableError:
            raise DestinationNotFoundError(
                f"queue {self.names.poison!r} does not exist on {self.where}: provision an endpoint first") from None
        except NackError as exc:
            raise UnavailableError(f"{self.names.poison!r} refused a message: {_describe(exc)}") from None
        except AMQPError as exc:
            self._drop_holder()
            raise UnavailableError(f"could not move taken messages to {self.names.poison!r} on {self.where} "
                                   f"(the broker puts back the unacknowledged ones): {_describe(exc)}") from None
        return len(taken)

    def release_held(self, receipts: Iterable[Any]) -> None:
        try:
            channel, taken = self._holding(receipts)
        except UnavailableError:
            return  # their channel closed: the broker has put them back already
        try:
            for r in taken:
                channel.basic_nack(r.tag, requeue=True)
        except AMQPError:
            self._drop_holder()  # closing the channel puts back whatever it still holds

    def _holding(self, receipts: Iterable[Any]) -> tuple[Any, list[_HeldReceipt]]:
        """The holding channel and the receipts; delivery tags mean nothing on any other channel."""
        taken = list(receipts)
        channel = self._holder
        if taken and (channel is None or not channel.is_open or any(r.channel is not channel for r in taken)):
            raise UnavailableError(f"the channel that took {len(taken)} message(s) from the delay levels on "
                                   f"{self.where} closed: the broker has put them back")
        return channel, taken

    def _drop_holder(self) -> None:
        channel, self._holder = self._holder, None
        try:
            if channel is not None and channel.is_open:
                channel.close()
        except AMQPError:
            pass  # a channel that cannot close is gone already: the broker puts its messages back

    def _stored_form(self, key: str, properties, body: bytes) -> DelayedMessage | None:
        words = key.split(".", self.names.levels)
        if len(words) <= self.names.levels or not properties.message_id:
            return None
        try:
            headers, due = _unwrap(properties)
            if due is None:
                return None
            return DelayedMessage(destination=words[-1], body=body, due_at=due, headers=headers,
                                  message_id=properties.message_id)
        except (ValueError, DelayProviderError):
            return None


@dataclass(eq=False)
class _HeldReceipt:
    """Settles a message taken from a level; its delivery tag belongs to the channel that took it."""

    channel: Any
    tag: int
    properties: Any
    body: bytes


def _unwrap(properties) -> tuple[dict[str, str], datetime | None]:
    """The caller's headers (the delay mechanics' own stripped) and the due time, as published."""
    raw = dict(properties.headers or {})
    due = raw.get(HEADER_DUE_AT)
    headers = {k: _text(v) for k, v in raw.items() if k not in STRIPPED_HEADERS}
    return headers, datetime.fromisoformat(_text(due)) if due else None


def _received(endpoint: str, method, properties, body: bytes, now: datetime) -> ReceivedMessage:
    headers, due = _unwrap(properties)
    return ReceivedMessage(
        message_id=properties.message_id or "",
        destination=endpoint,
        body=body,
        headers=headers,
        receipt=method.delivery_tag,
        enqueued_at=now,  # RabbitMQ does not say when a message arrived: the receive time, on the due times' clock
        due_at=due,
        receive_count=2 if method.redelivered else 1,
        extra={"routing_key": method.routing_key, "exchange": method.exchange},
    )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"


# -- publishing with windowed confirms ----------------------------------------------------------
@dataclass
class Publication:
    """A message as published: persistent, with its id and headers as properties."""

    message_id: str
    exchange: str
    routing_key: str
    body: bytes
    headers: dict[str, Any]


#: The properties every publication has, in the order AMQP 0-9-1 encodes them: headers, delivery_mode, message_id.
_PROPERTY_FLAGS = pika.spec.BasicProperties.FLAG_HEADERS | pika.spec.BasicProperties.FLAG_DELIVERY_MODE \
    | pika.spec.BasicProperties.FLAG_MESSAGE_ID
_PERSISTENT = struct.pack("B", 2)


def header_frame(channel: int, p: Publication) -> bytes:
    """The content header frame `pika.frame.Header(channel, len(body), BasicProperties(message_id=..., headers=...,
    delivery_mode=2)).marshal()` gives, without building BasicProperties or checking the fields it does not use:
    a third of a publish's encoding time. Values are encoded by pika's own table and string encoders."""
    pieces = [struct.pack(">HxxQH", pika.spec.BasicProperties.INDEX, len(p.body), _PROPERTY_FLAGS)]
    _encode_table(pieces, p.headers)
    pieces.append(_PERSISTENT)
    pika.data.encode_short_string(pieces, p.message_id)
    payload = b"".join(pieces)
    return struct.pack(">BHI", pika.spec.FRAME_HEADER, channel, len(payload)) + payload + _FRAME_END


_FRAME_END = bytes((pika.spec.FRAME_END,))


def body_frames(out: list[bytes], channel: int, body: bytes, max_length: int) -> None:
    """Append the body frames of `body` (pieces of at most `max_length` bytes): the bytes of
    `pika.frame.Body(channel, piece).marshal()` for each piece, without building the objects."""
    for start in range(0, len(body), max_length):
        piece = body[start:start + max_length]
        out.append(struct.pack(">BHI", pika.spec.FRAME_BODY, channel, len(piece)) + piece + _FRAME_END)


def _encode_table(pieces: list[bytes], table: dict[str, Any]) -> None:
    """pika.data.encode_table, with the common case (text values, short keys) encoded in one pass."""
    parts = []
    for key, value in table.items():
        name = key.encode()
        if type(value) is not str or len(name) > 255:  # anything else: pika's encoder (and its errors)
            pika.data.encode_table(pieces, table)
            return
        text = value.encode()
        parts.append(b"%c%bS%b%b" % (len(name), name, len(text).to_bytes(4, "big"), text))
    encoded = b"".join(parts)
    pieces.append(len(encoded).to_bytes(4, "big"))
    pieces.append(encoded)


class PublishNacked(UnavailableError):
    """The broker could not take responsibility for a message now (a resource alarm, a quorum queue
    leader change, a queue at its length limit with reject-publish): an outage, not the message's
    fault, so the pump releases it untouched and its dispatch circuit breaker decides."""


class _Batch:
    """Messages of one send: done when each is confirmed, returned, nacked or failed (not confirmed in time, or the
    connection failed)."""

    def __init__(self, size: int) -> None:
        self.remaining = size
        self.unsent = size  # kept back while the window is full
        #: When its last message went out (until then, when it was started): its confirms are waited for from then.
        self.sent_at = time.monotonic()
        self.failures: dict[str, Exception] = {}


class ConfirmingPublisher:
    """A SelectConnection channel in confirm mode, driven from the calling thread.

    Up to `window` messages are in flight, across batches: `start` queues a batch and returns at
    once, `wait` runs the I/O loop until that batch is settled. Each message ends acked (queued),
    returned (no queue takes it: acked after a return), nacked, or failed by `wait` when not confirmed
    in time. After a nack the channel is replaced once nothing is in flight on it: RabbitMQ 3.x keeps
    a channel that a full queue refused refusing even after the limit is lifted, while a new channel
    is asked afresh.
    """

    def __init__(self, parameters: pika.ConnectionParameters, window: int = 1000, timeout: float = 30.0) -> None:
        self.window = window
        self.timeout = timeout
        self._error: BaseException | None = None
        self._channel = None
        self._ready = False
        self._tag = 0
        self._outstanding: dict[int, tuple[_Batch, str]] = {}
        #: Tags (ascending) of messages failed as not confirmed in time, by message id: their confirms, if they
        #: come, are recognised and ignored. They do not count against the window.
        self._abandoned: dict[int, str] = {}
        self._confirmed_at = float("-inf")  # when the channel last confirmed anything
        self._pending: deque[tuple[_Batch, Publication]] = deque()
        self._returned: dict[str, Exception] = {}
        self._renewing = False  # nacked: publish nothing more on this channel, replace it when settled
        self._stuck = False  # confirmed nothing for a whole timeout: takes no new batch, closes once idle
        self._method_frames: dict[tuple[int, str, str], bytes] = {}
        self._until = lambda: True
        self._last_io = time.monotonic()
        self._connection = pika.SelectConnection(
            parameters,
            on_open_callback=lambda conn: conn.channel(on_open_callback=self._on_channel),
            on_open_error_callback=self._on_failure,
            on_close_callback=self._on_failure,
        )
        self._run(until=lambda: self._ready or self._error is not None, timeout=timeout)
        if not self._ready:
            where = f"{parameters.host}:{parameters.port}"
            error = self._error or TimeoutError(f"no connection within {timeout:.0f} s")
            self.close()
            raise UnavailableError(f"could not connect to RabbitMQ at {where}: {_describe(error)}")

    @property
    def is_open(self) -> bool:
        """True while it takes new batches: ready once constructed; renewing is open too."""
        return self._error is None and not self._stuck and self._connection.is_open

    @property
    def is_closed(self) -> bool:
        return bool(self._connection.is_closed)

    @property
    def busy(self) -> bool:
        """Messages of some batch are waiting for room in the window or for their confirms."""
        return bool(self._outstanding or self._pending)

    def stale(self, heartbeat: int | None) -> bool:
        """Idle, with nothing in flight, for more than half the heartbeat interval."""
        idle = time.monotonic() - self._last_io
        return not self.busy and bool(heartbeat) and idle > heartbeat / 2

    def _on_channel(self, channel) -> None:
        self._channel = channel
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._on_return)
        channel.confirm_delivery(self._on_confirm, callback=self._on_confirm_mode)

    def _on_confirm_mode(self, _frame) -> None:
        self._ready = True
        self._tag = 0
        self._fill()
        self._check_done()

    def _on_channel_closed(self, channel, error) -> None:
        if channel is self._channel:  # a channel retired after a nack closes quietly
            self._on_failure(channel, error)

    def _renew_channel(self) -> None:
        self._renewing = self._ready = False
        # Tags count afresh on the new channel: whatever the old one may still confirm is of no batch.
        self._abandoned.clear()
        self._returned.clear()
        retired, self._channel = self._channel, None
        retired.close()
        self._connection.channel(on_open_callback=self._on_channel)

    def _on_failure(self, _source, error) -> None:
        self._error = error
        self._stop()

    def _stop(self) -> None:
        self._connection.ioloop.stop()

    def _run(self, until, timeout: float) -> None:
        if until():
            return
        timer = self._connection.ioloop.call_later(timeout, self._stop)
        self._until = until
        self._connection.ioloop.start()
        self._connection.ioloop.remove_timeout(timer)
        self._last_io = time.monotonic()

    def _check_done(self) -> None:
        if self._until():
            self._stop()

    # confirms: tags count publishes on this channel from 1
    def _on_confirm(self, frame) -> None:
        if self._channel is None or frame.channel_number != self._channel.channel_number:
            return  # from a channel retired after a nack, whose tags are no longer ours
        self._confirmed_at = time.monotonic()
        method = frame.method
        tag = method.delivery_tag
        # Outstanding tags are in publishing order: a multiple confirm covers a prefix of them.
        tags = list(takewhile(lambda t: t <= tag, self._outstanding)) if method.multiple else [tag]
        if self._abandoned:
            late = list(takewhile(lambda t: t <= tag, self._abandoned)) if method.multiple else [tag]
            for t in late:
                mid = self._abandoned.pop(t, None)
                if mid is not None:  # its batch failed it already: only forget its return, if any
                    self._returned.pop(mid, None)
        nacked = isinstance(method, pika.spec.Basic.Nack)
        for tag in tags:
            entry = self._outstanding.pop(tag, None)
            if entry is None:
                continue
            batch, mid = entry
            batch.remaining -= 1
            returned = self._returned.pop(mid, None)
            if returned is not None:
                batch.failures[mid] = returned
            elif nacked:
                batch.failures[mid] = PublishNacked(
                    f"RabbitMQ nacked message {mid}: it cannot take it now (resource alarm, leader change or a "
                    "queue at its length limit); send it again later"
                )
        self._renewing = self._renewing or nacked
        self._settled()
        self._check_done()

    def _settled(self) -> None:
        """Room in the window: publish what waits (or, after a nack, replace the channel once nothing is in flight)."""
        if self._renewing and not self._outstanding:
            self._renew_channel()
        self._fill()

    def _on_return(self, _channel, method, properties, _body) -> None:
        # A return comes before the ack of the same message: remember it until then.
        self._returned[properties.message_id] = DestinationNotFoundError(
            f"no queue takes routing key {method.routing_key!r} ({method.reply_code} {method.reply_text}); "
            "provision the destination first"
        )

    def _fill(self) -> None:
        frames: list[bytes] = []
        while self._ready and not self._renewing and self._pending and len(self._outstanding) < self.window:
            if not frames and not self._channel.is_open:
                raise ChannelWrongStateError("the publishing channel is closed")
            batch, p = self._pending.popleft()
            self._tag += 1
            self._outstanding[self._tag] = (batch, p.message_id)
            self._marshal(p, frames)
            batch.unsent -= 1
            if not batch.unsent:
                batch.sent_at = time.monotonic()
        if frames:
            self._write(frames)

    # What channel.basic_publish does per message, with the frames of the whole window written at once:
    # pika writes each frame to the socket on its own (three sends per message), which costs more than
    # encoding it. The Basic.Publish frame of an exchange and routing key is encoded once and reused.
    def _marshal(self, p: Publication, out: list[bytes]) -> None:
        number = self._channel.channel_number
        method = self._method_frames.get((number, p.exchange, p.routing_key))
        if method is None:
            if len(self._method_frames) > 10_000:
                self._method_frames.clear()
            method = pika.frame.Method(number, pika.spec.Basic.Publish(
                exchange=p.exchange, routing_key=p.routing_key, mandatory=True)).marshal()
            self._method_frames[(number, p.exchange, p.routing_key)] = method
        out.append(method)
        out.append(header_frame(number, p))
        body_frames(out, number, p.body, self._connection._body_max_length)

    def _write(self, frames: list[bytes]) -> None:
        self._connection._output_marshaled_frames([b"".join(frames)])

    def start(self, publications: Sequence[Publication]) -> _Batch:
        """Queue a batch for publishing and push out what the window allows; returns at once."""
        if not self.is_open:
            raise UnavailableError(f"the RabbitMQ publisher connection is closed: {self._error}")
        batch = _Batch(len(publications))
        self._pending.extend((batch, p) for p in publications)
        try:
            self._fill()
        except AMQPError as exc:
            self._error = exc
        # Frames leave only while the I/O loop runs: give it a moment now, so the broker works on
        # this batch while the caller prepares the next one.
        self._run(until=lambda: self._error is not None, timeout=0.001)
        return batch

    def wait(self, batch: _Batch) -> dict[str, Exception]:
        """Run the I/O loop until the batch is settled, or `timeout` has passed since its last message went out;
        returns its failures by message id.

        Unconfirmed messages fail as unavailable (the pump releases them and sends them again: at least
        once). A timeout fails only this batch: later batches wait for their own confirms, and confirms that
        come late for this one are ignored. When the channel confirmed nothing at all in that time, it (or its
        connection) is stuck: the publisher takes no new batch (the transport opens a new one) and closes once
        the batches it has are done. A lost connection fails every unsettled message of every batch at once:
        nothing can be confirmed any more.
        """
        while batch.remaining and self._error is None:
            left = batch.sent_at + self.timeout - time.monotonic()
            if left <= 0:
                break
            # Once its last message is out, its deadline moves: look again.
            self._run(until=partial(self._waited, batch, batch.unsent), timeout=left)
        if self._error is not None:
            self._fail(self._error, lambda _owner: True)
        elif batch.remaining:
            self._stuck = self._stuck or self._confirmed_at < batch.sent_at
            self._fail(TimeoutError(f"no confirm within {self.timeout:.0f} s"), lambda owner: owner is batch)
            try:
                self._settled()  # its room in the window goes to the batches behind it
            except AMQPError as exc:
                self._error = exc
        if not self.is_open and not self.busy:
            self.close()
        return batch.failures

    def _waited(self, batch: _Batch, unsent: int) -> bool:
        return not batch.remaining or self._error is not None or batch.unsent != unsent

    def _fail(self, reason: BaseException, which: Callable[[_Batch], bool]) -> None:
        """Fail every unsettled message of the batches `which` picks; their tags are kept apart (`_abandoned`)."""
        error = UnavailableError(f"not confirmed by RabbitMQ: {_describe(reason)}")
        for tag, (owner, mid) in list(self._outstanding.items()):
            if which(owner):
                del self._outstanding[tag]
                self._abandoned[tag] = mid
                # A return comes just before its ack: the message is known not to be queued.
                owner.failures.setdefault(mid, self._returned.pop(mid, error))
                owner.remaining = 0
        kept: deque[tuple[_Batch, Publication]] = deque()
        for owner, p in self._pending:
            if which(owner):
                owner.failures.setdefault(p.message_id, error)
                owner.remaining = 0
            else:
                kept.append((owner, p))
        self._pending = kept
        self._abandoned = dict(sorted(self._abandoned.items()))  # batches may time out out of order

    def close(self) -> None:
        """Close the connection. A stuck one is dropped instead: the broker closes a channel only once the queues
        it published to answer, and cleans up after a dropped socket by itself."""
        if self._connection.is_open and not self._stuck:
            self._connection.close()
            self._run(until=lambda: self._connection.is_closed, timeout=5)
        if self._connection.is_open or self._connection.is_closing:
            # What pika itself does to a connection whose heartbeats stopped.
            dropped = AMQPConnectionError("dropped: RabbitMQ did not confirm or close in time")
            self._connection._terminate_stream(dropped)
            self._run(until=lambda: self._connection.is_closed, timeout=5)

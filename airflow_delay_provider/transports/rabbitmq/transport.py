"""The RabbitMQ transport: provisions the levels and endpoint queues, publishes each message into the
level its delay starts at (or straight to its queue when due), receives, and hands back what the
levels hold for a migration to the store.

A connection's extras (see hooks.rabbitmq.connection_spec) become pika parameters and transport
options here, so a process without Airflow (a Spark executor) builds the same transport.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any

import pika
from pika.exceptions import AMQPConnectionError, AMQPError, ChannelClosedByBroker

from airflow_delay_provider.core.checks import check_int
from airflow_delay_provider.core.delays import seconds_until
from airflow_delay_provider.core.errors import (
    DelayError,
    DestinationNotFoundError,
    InvalidInputError,
    InvalidNameError,
    UnavailableError,
)
from airflow_delay_provider.core.message import HEADER_DUE_AT, DelayedMessage
from airflow_delay_provider.core.ports import HeldMessage, ReceivedMessage, Transport
from airflow_delay_provider.transports.rabbitmq.holding import LevelHolder
from airflow_delay_provider.transports.rabbitmq.publisher import (
    DELAY_HEADER,
    ConfirmingPublisher,
    Publication,
    describe_error,
    unwrap,
)
from airflow_delay_provider.transports.rabbitmq.routing import (
    LEVELS,
    check_endpoint,
    check_levels,
    first_level,
    routing_key,
)
from airflow_delay_provider.transports.rabbitmq.topology import (
    DELIVERY_LIMIT,
    Names,
    Queue,
    Topology,
    delay_topology,
    delivery_limit_policy,
    endpoint_binding_key,
    endpoint_topology,
)

log = logging.getLogger(__name__)


def _flag(value: Any) -> bool:
    """Extras from URI-style connections arrive as strings."""
    return value is True or str(value).lower() in ("true", "1", "yes")


#: The integer connection extras: their default and allowed range.
_INT_EXTRAS = {"heartbeat": (60, 0, None), "levels": (LEVELS, 1, LEVELS), "confirm_window": (1000, 1, None),
               "delivery_limit": (DELIVERY_LIMIT, 1, None)}


def _int_extra(spec: dict[str, Any], name: str) -> int:
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


def parameters_from_spec(spec: dict[str, Any]) -> tuple[pika.ConnectionParameters, dict[str, Any]]:
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
    delays_natively = True

    def __init__(
        self,
        parameters: pika.ConnectionParameters,
        prefix: str = "delay",
        levels: int = LEVELS,
        confirm_window: int = 1000,
        confirm_timeout: float = 30.0,
        delivery_limit: int = DELIVERY_LIMIT,
    ) -> None:
        # RabbitMQ 4.x reads -1 as "no limit", 3.x as "drop at the first redelivery": neither is allowed.
        check_int("delivery_limit", delivery_limit, 1)
        check_int("confirm_window", confirm_window, 1)  # 0 would publish nothing and time every send out
        self.parameters = parameters
        self.names = Names(prefix, levels)
        self.delivery_limit = delivery_limit
        self.confirm_window = confirm_window
        self.confirm_timeout = confirm_timeout
        self._publisher: ConfirmingPublisher | None = None
        self._retired: list[ConfirmingPublisher] = []  # stuck ones still finishing the batches they have
        self._admin: pika.BlockingConnection | None = None
        self._consumer: Any = None  # the channel receive() and ack() share: delivery tags belong to it
        #: Messages taken from the levels, on a channel of the admin connection, until settled.
        self._holding = LevelHolder(self.names, self.where, self._channel, self._connection_lost)
        self._levels_declared = False

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> RabbitMQTransport:
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
    def _channel(self) -> Any:
        """A fresh channel on the admin connection, reconnecting once if the broker dropped it."""
        for attempt in (1, 2):
            if self._admin is None or self._admin.is_closed:
                try:
                    self._admin = pika.BlockingConnection(self.parameters)
                except AMQPError as exc:
                    raise UnavailableError(f"could not connect to {self.where}: {describe_error(exc)}") from None
            try:
                return self._admin.channel()
            except AMQPConnectionError:
                self._connection_lost()
                if attempt == 2:
                    raise UnavailableError(f"the connection to {self.where} keeps closing") from None

    def close(self) -> None:
        for conn in (self._admin, self._publisher, *self._retired):
            try:
                if conn is not None and not conn.is_closed:
                    conn.close()
            except AMQPError:
                pass  # already going away: nothing left to release
        self._admin = self._publisher = self._consumer = None
        self._holding.forget()
        self._retired = []

    # -- provisioning ------------------------------------------------------------------------------
    def declare(self, topology: Topology) -> dict[str, Any]:
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

    def _declare_legacy(self, channel: Any, queue: Queue, refusal: ChannelClosedByBroker) -> None:
        """Accept `queue` as an earlier version declared it; otherwise re-raise the first refusal,
        which names the argument that differs."""
        try:
            channel.queue_declare(queue.name, durable=True, arguments=queue.legacy_arguments)
        except ChannelClosedByBroker:
            raise refusal from None

    def check_endpoint(self, endpoint: str, **options: Any) -> str:
        return check_endpoint(endpoint, self.names.levels)

    def check_delay(self, message: DelayedMessage, seconds: int) -> None:
        check_levels(seconds, self.names.levels)

    def provision(self, endpoint: str) -> dict[str, Any]:
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

    def teardown(self, endpoint: str) -> dict[str, Any]:
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

    def verify(self, endpoints: Iterable[str] = ()) -> dict[str, Any]:
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

    def _check(self, report: dict[str, Any], name: str, exists: Callable[..., object],
               equivalent: Callable[..., object], legacy: Callable[..., object] | None = None) -> None:
        # Each callable takes a channel; `...`: the callers' lambdas bind their queue or exchange as a default argument.
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
            self._connection_lost()
            raise UnavailableError(f"lost the connection to {self.where}: {describe_error(exc)}") from None
        finally:
            if channel.is_open:
                channel.close()

    # -- sending ------------------------------------------------------------------------------------
    pipelined = True

    def send(self, messages: Sequence[DelayedMessage], connection: Any = None) -> dict[str, Exception]:
        return self.send_start(messages, connection)()

    def send_start(
        self, messages: Sequence[DelayedMessage], connection: Any = None
    ) -> Callable[[], dict[str, Exception]]:
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
                    check_endpoint(m.destination, self.names.levels)
                    bad_names[m.destination] = None
                except InvalidNameError as exc:
                    bad_names[m.destination] = exc
            try:
                bad_name = bad_names[m.destination]
                if bad_name is not None:
                    raise bad_name
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
        headers: dict[str, Any] = {**m.headers, HEADER_DUE_AT: m.due_at.isoformat()}
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
                self._connection_lost()
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
        """Basic.get up to `max_messages` from the delay levels, level 27 down to 0; see LevelHolder.take."""
        return self._holding.take(max_messages)

    def ack_held(self, receipts: Iterable[Any]) -> int:
        return self._holding.ack(receipts)

    def poison_held(self, receipts: Iterable[Any]) -> int:
        """Publish each to `<prefix>.poison` as it was, then acknowledge it: the ack waits for the confirm."""
        return self._holding.poison(receipts)

    def release_held(self, receipts: Iterable[Any]) -> None:
        self._holding.release(receipts)

    def _connection_lost(self) -> None:
        """The admin connection is gone, and with it the channels receive() and the holder used."""
        self._admin = self._consumer = None


def _received(endpoint: str, method: pika.spec.Basic.GetOk, properties: pika.spec.BasicProperties, body: bytes,
              now: datetime) -> ReceivedMessage:
    headers, due = unwrap(properties)
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

"""Publishing with publisher confirms, many messages in flight (a window), so a batch is fast and every
message is known to be queued, returned (no such queue) or nacked (the broker cannot take it now: an
outage, never the message's fault).

The frames are encoded here and written a window at a time, not through `channel.basic_publish`:
pika writes each frame to the socket on its own and builds a `BasicProperties` per message, which
together cost more than encoding them (bench/profile_pump.py times each stage of a pump's batch).
The encoding is checked byte for byte against pika's own by property tests.
"""

from __future__ import annotations

import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from itertools import takewhile
from typing import Any

import pika
import pika.data
import pika.frame
import pika.spec
from pika.exceptions import AMQPConnectionError, AMQPError, ChannelWrongStateError

from airflow_delay_provider.core.errors import DestinationNotFoundError, UnavailableError
from airflow_delay_provider.core.message import HEADER_DUE_AT

DELAY_HEADER = "x-delay-seconds"
#: Headers the broker or the delay mechanics add; receivers never see them.
STRIPPED_HEADERS = frozenset(
    {DELAY_HEADER, HEADER_DUE_AT, "x-delivery-count", "x-death", "x-first-death-queue", "x-first-death-reason",
     "x-first-death-exchange", "x-last-death-queue", "x-last-death-reason", "x-last-death-exchange"}
)


@dataclass
class Publication:
    """A message as published: persistent, with its id and headers as properties."""

    message_id: str
    exchange: str
    routing_key: str
    body: bytes
    headers: dict[str, Any]


def unwrap(properties: pika.spec.BasicProperties) -> tuple[dict[str, str], datetime | None]:
    """The caller's headers (the delay mechanics' own stripped) and the due time, as published."""
    raw = dict(properties.headers or {})
    due = raw.get(HEADER_DUE_AT)
    headers = {k: _text(v) for k, v in raw.items() if k not in STRIPPED_HEADERS}
    return headers, datetime.fromisoformat(_text(due)) if due else None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def describe_error(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"


#: The properties every publication has, in the order AMQP 0-9-1 encodes them: headers, delivery_mode, message_id.
_PROPERTY_FLAGS = pika.spec.BasicProperties.FLAG_HEADERS | pika.spec.BasicProperties.FLAG_DELIVERY_MODE \
    | pika.spec.BasicProperties.FLAG_MESSAGE_ID
_PERSISTENT = struct.pack("B", 2)


def header_frame(channel: int, p: Publication) -> bytes:
    """The content header frame of a publication, as pika would marshal it, without pika's objects.

    The bytes `pika.frame.Header(channel, len(body), BasicProperties(message_id=..., headers=..., delivery_mode=2))`
    marshals, without building BasicProperties or checking the fields it does not use: a third of a publish's
    encoding time. Values are encoded by pika's own table and string encoders."""
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
        self._channel: Any = None  # the pika channel in confirm mode, once open
        self._body_max = 0
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
        self._until: Callable[[], bool] = lambda: True
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
            raise UnavailableError(f"could not connect to RabbitMQ at {where}: {describe_error(error)}")

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
        return not self.busy and bool(heartbeat and idle > heartbeat / 2)

    def _on_channel(self, channel: Any) -> None:
        self._channel = channel
        # A body frame's payload: the frame size the connection negotiated, less the frame's header and end.
        self._body_max = self._connection.params.frame_max - pika.spec.FRAME_HEADER_SIZE - pika.spec.FRAME_END_SIZE
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._on_return)
        channel.confirm_delivery(self._on_confirm, callback=self._on_confirm_mode)

    def _on_confirm_mode(self, _frame: pika.frame.Method) -> None:
        self._ready = True
        self._tag = 0
        self._fill()
        self._check_done()

    def _on_channel_closed(self, channel: Any, error: BaseException) -> None:
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

    def _on_failure(self, _source: Any, error: BaseException) -> None:
        self._error = error
        self._stop()

    def _stop(self) -> None:
        self._connection.ioloop.stop()

    def _run(self, until: Callable[[], bool], timeout: float) -> None:
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
    def _on_confirm(self, frame: pika.frame.Method) -> None:
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

    def _on_return(self, _channel: Any, method: pika.spec.Basic.Return, properties: pika.spec.BasicProperties,
                   _body: bytes) -> None:
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
        body_frames(out, number, p.body, self._body_max)

    def _write(self, frames: list[bytes]) -> None:
        # pika's private writer: its public publish path is the per-frame one this replaces, and the
        # frames must go through its output buffer to keep the connection's own writes in order.
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
        error = UnavailableError(f"not confirmed by RabbitMQ: {describe_error(reason)}")
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
            # What pika itself does to a connection whose heartbeats stopped (a private call: pika has no
            # public way to drop a connection without the close handshake the stuck broker does not answer).
            dropped = AMQPConnectionError("dropped: RabbitMQ did not confirm or close in time")
            self._connection._terminate_stream(dropped)
            self._run(until=lambda: self._connection.is_closed, timeout=5)

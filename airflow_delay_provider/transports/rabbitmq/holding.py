"""Taking back what the delay levels hold, for a migration to the store.

Messages are read off the levels (basic.get) and held unacknowledged on one channel until the
store has them: then acknowledged, moved to poison (those that cannot be stored) or released. If
the channel closes first, the broker puts them back in their levels, so nothing is lost or taken
twice by a migration that stops half-way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pika.exceptions import AMQPConnectionError, AMQPError, ChannelClosedByBroker, NackError, UnroutableError

from airflow_delay_provider.core.errors import DelayProviderError, DestinationNotFoundError, UnavailableError
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.ports import HeldMessage
from airflow_delay_provider.transports.rabbitmq.publisher import describe_error, unwrap
from airflow_delay_provider.transports.rabbitmq.topology import Names


@dataclass(eq=False)
class HeldReceipt:
    """Settles a message taken from a level; its delivery tag belongs to the channel that took it."""

    channel: Any
    tag: int
    properties: Any
    body: bytes


class LevelHolder:
    """Holds messages taken from the levels on one channel of the transport's connection.

    :param names: the delay infrastructure's names (the levels, poison).
    :param where: the broker, as logs and errors name it.
    :param open_channel: a fresh channel on the transport's connection.
    :param connection_lost: tells the transport its connection is gone.
    """

    def __init__(self, names: Names, where: str, open_channel: Callable[[], Any],
                 connection_lost: Callable[[], None]) -> None:
        self.names = names
        self.where = where
        self._open_channel = open_channel
        self._connection_lost = connection_lost
        self._channel: Any = None

    def forget(self) -> None:
        """The connection was closed: whatever the channel held is back in the levels."""
        self._channel = None

    def take(self, max_messages: int) -> list[HeldMessage]:
        """Basic.get up to `max_messages` from the delay levels, level 27 down to 0 (a message expiring
        meanwhile drops to a lower level, read later). A message without a message id or a due-time
        header comes as None (poison). They stay unacknowledged on one channel until settled; if it
        closes first, the broker puts them back in their levels."""
        held: list[HeldMessage] = []
        try:
            if self._channel is None or not self._channel.is_open:
                self._channel = self._open_channel()
                self._channel.confirm_delivery()  # a poison publish returns only once the poison queue has it
            channel = self._channel
            for n in range(self.names.levels - 1, -1, -1):
                while len(held) < max_messages:
                    method, properties, body = channel.basic_get(self.names.level(n), auto_ack=False)
                    if method is None:
                        break
                    message = self._stored_form(method.routing_key, properties, body)
                    held.append(HeldMessage(message, HeldReceipt(channel, method.delivery_tag, properties, body)))
        except ChannelClosedByBroker as exc:
            self._channel = None
            raise DestinationNotFoundError(f"cannot read the delay levels on {self.where}: {exc.reply_text}") from None
        except AMQPConnectionError as exc:
            self._channel = None
            self._connection_lost()
            raise UnavailableError(f"lost the connection to {self.where} while reading the delay levels "
                                   f"(the broker puts back what was taken): {describe_error(exc)}") from None
        return held

    def ack(self, receipts: Iterable[Any]) -> int:
        channel, taken = self._holding(receipts)
        try:
            for r in taken:
                channel.basic_ack(r.tag)
        except AMQPError as exc:
            self._drop_channel()
            raise UnavailableError(f"could not acknowledge taken messages on {self.where} (the broker puts "
                                   f"back the unacknowledged ones): {describe_error(exc)}") from None
        return len(taken)

    def poison(self, receipts: Iterable[Any]) -> int:
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
            raise UnavailableError(f"{self.names.poison!r} refused a message: {describe_error(exc)}") from None
        except AMQPError as exc:
            self._drop_channel()
            raise UnavailableError(f"could not move taken messages to {self.names.poison!r} on {self.where} "
                                   f"(the broker puts back the unacknowledged ones): {describe_error(exc)}") from None
        return len(taken)

    def release(self, receipts: Iterable[Any]) -> None:
        try:
            channel, taken = self._holding(receipts)
        except UnavailableError:
            return  # their channel closed: the broker has put them back already
        try:
            for r in taken:
                channel.basic_nack(r.tag, requeue=True)
        except AMQPError:
            self._drop_channel()  # closing the channel puts back whatever it still holds

    def _holding(self, receipts: Iterable[Any]) -> tuple[Any, list[HeldReceipt]]:
        """The holding channel and the receipts; delivery tags mean nothing on any other channel."""
        taken = list(receipts)
        channel = self._channel
        if taken and (channel is None or not channel.is_open or any(r.channel is not channel for r in taken)):
            raise UnavailableError(f"the channel that took {len(taken)} message(s) from the delay levels on "
                                   f"{self.where} closed: the broker has put them back")
        return channel, taken

    def _drop_channel(self) -> None:
        channel, self._channel = self._channel, None
        try:
            if channel is not None and channel.is_open:
                channel.close()
        except AMQPError:
            pass  # a channel that cannot close is gone already: the broker puts its messages back

    def _stored_form(self, key: str, properties: Any, body: bytes) -> DelayedMessage | None:
        words = key.split(".", self.names.levels)
        if len(words) <= self.names.levels or not properties.message_id:
            return None
        try:
            headers, due = unwrap(properties)
            if due is None:
                return None
            return DelayedMessage(destination=words[-1], body=body, due_at=due, headers=headers,
                                  message_id=properties.message_id)
        except (ValueError, DelayProviderError):
            return None

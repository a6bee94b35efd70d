"""The two interfaces the pump works against: a delayed-message store and a transport.

Stores and transports live in their own packages (SQL today; RabbitMQ and SQS slot in behind
`Transport`). Nothing here imports a database or broker client.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

from airflow_delay_provider.core.backlog import BODY_PREVIEW_BYTES, Selector
from airflow_delay_provider.core.delays import UTC
from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.core.history import HistoryPage, Settled, story_report
from airflow_delay_provider.core.message import DelayedMessage, check_destination

#: How long a store remembers an accepted message id (seconds): within it, the same id is neither stored nor sent
#: natively again. Like SQS FIFO's five-minute window or Cloud Tasks' task names, but longer.
DEFAULT_DEDUP_WINDOW_SECONDS = 86_400


class Claim(ABC):
    """A batch of due messages held exclusively until the claim ends (commit on success, release on error)."""

    messages: list[DelayedMessage]
    #: The open database transaction, for a transport that can join it (exactly-once dispatch).
    connection: Any = None

    @abstractmethod
    def remove(self, message_ids: Iterable[str]) -> int:
        """Delete delivered or dead-lettered messages; returns how many rows went."""

    @abstractmethod
    def retry(self, next_due: Mapping[str, datetime], headers: Mapping[str, dict[str, str]] | None = None) -> None:
        """Count one more failure for each message and make it due again at the given time
        (replacing its headers where `headers` has new ones)."""

    def record(self, handed_at: datetime, groups: Sequence[Settled]) -> None:  # noqa: B027 - a store may keep none
        """Add the batch's outcomes to the delivery history (core/history.py), committed with the claim or not at
        all."""


class DelayedMessageStore(ABC):
    """Durable home of messages until they are due."""

    #: True when one process may hold two claims at once (row locks, not a database-wide write lock).
    concurrent_claims: bool = False
    #: True when a claim may be taken in another thread while this one settles an earlier claim (each claim
    #: its own connection from a thread-safe pool).
    threaded_claims: bool = False

    def upkeep(self) -> None:  # noqa: B027 - optional: a store in memory has no tables to look after
        """Look after the store's tables (statistics, dead rows) if it is time; called by pumps between
        batches, so it must return at once. Nothing to do by default."""

    def ready_for(self, due: datetime) -> None:  # noqa: B027 - optional: a store in memory has nothing to read
        """Read now what a claim at `due` would otherwise read first (where its scan starts): called by a pump just
        before it wakes for a due time. Nothing by default."""

    def check_ready(self) -> None:  # noqa: B027 - optional: a store in memory has no tables to wait for
        """Raise StoreNotReadyError (saying what to run) while the store's tables are not there: a pump waits
        then, without counting it against its breakers. Called before each claim, so it must be cheap once they
        are there. Ready by default."""

    @abstractmethod
    def store(self, messages: Sequence[DelayedMessage], deduplicate: bool = True, on_duplicate: str = "skip") -> int:
        """Store messages atomically (all or none); ids already stored, or (with `deduplicate`) accepted
        within the store's de-duplication window, are duplicates: skipped, or (`on_duplicate`, see
        core/duplicates.py) changing the stored message while it is stored. Returns how many were new or
        changed. The messages' destinations become known (see `destinations`)."""

    @abstractmethod
    def claim_due(
        self, now: datetime, limit: int, due_before: datetime | None = None, exclude: Collection[str] = ()
    ) -> AbstractContextManager[Claim]:
        """Claim up to `limit` messages due at `now` (and before `due_before`), oldest first,
        leaving out the destinations in `exclude` and paused ones."""

    @abstractmethod
    def next_due(self, destination: str | None = None, due_before: datetime | None = None) -> datetime | None:
        """Due time of the earliest stored message of a destination that is not paused, or None."""

    @abstractmethod
    def count_scheduled(self, due_before: datetime | None = None) -> dict[str, int]:
        """Messages still stored per destination (a queue's NumberOfMessagesDelayed)."""

    def policies(self) -> dict[str, dict[str, Any]]:
        """Delivery policies stored per destination (delivery-policy JSON); none by default."""
        return {}

    #: True when take_tokens() keeps throttle buckets where every pump of the store shares them.
    shared_throttle: bool = False

    def take_tokens(self, destination: str, rate: float, n: int) -> tuple[int, float]:
        """Take up to `n` delivery tokens of `destination`'s shared bucket (refilled at `rate` per second,
        holding at most one second's worth); returns (taken, tokens left)."""
        raise NotImplementedError

    def clock(self) -> datetime:
        """Now, on the clock due times are kept on (a shared database's, where hosts' clocks differ)."""
        return datetime.now(UTC)

    @abstractmethod
    def wait(self, until: datetime) -> None:
        """Sleep until `until`, returning earlier when a message due sooner is stored."""

    # -- operating the backlog (core/backlog.py has the selectors and report shapes) ---------------------
    def browse(self, selector: Selector, limit: int = 50, after: str | None = None,
               body_bytes: int | None = BODY_PREVIEW_BYTES) -> dict[str, Any]:
        """One page of scheduled messages, soonest first, claiming nothing: `{"messages", "next"}`."""
        raise NotImplementedError(f"{type(self).__name__} cannot browse its backlog")

    def backlog(self, destination: str | None = None) -> dict[str, Any]:
        """Counts per destination (scheduled, due, in flight, paused, due-time histogram) and totals."""
        raise NotImplementedError(f"{type(self).__name__} cannot count its backlog")

    def count_selected(self, selector: Selector, action: str = "cancel") -> dict[str, Any]:
        """What a change by `selector` would touch, changing nothing: `would_<action>` and `in_flight`
        (`core.backlog.count_report`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot count selected messages")

    def cancel(self, selector: Selector) -> dict[str, Any]:
        """Remove the selected messages; reports ids cancelled, in flight, gone and unknown."""
        raise NotImplementedError(f"{type(self).__name__} cannot cancel messages")

    def reschedule(self, selector: Selector, due_at: datetime) -> dict[str, Any]:
        """Make the selected messages due at `due_at` (never before now); reports like `cancel`."""
        raise NotImplementedError(f"{type(self).__name__} cannot reschedule messages")

    def edit(self, message_id: str, body: bytes | str | None = None,
             headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Change one scheduled message's body and/or headers by id (not once taken); reports like `cancel`, with
        `edited`."""
        raise NotImplementedError(f"{type(self).__name__} cannot edit messages")

    def purge(self, destination: str, dry_run: bool = True) -> dict[str, Any]:
        """Remove every scheduled message of one known destination (with `dry_run`, only count them)."""
        raise NotImplementedError(f"{type(self).__name__} cannot purge a destination")

    def pause_messages(self, selector: Selector) -> dict[str, Any]:
        """Hold the selected messages stored (never delivered, whatever their due time) until resumed; reports like
        `cancel`, with `paused` (`count_selected(selector, "pause")` counts first)."""
        raise NotImplementedError(f"{type(self).__name__} cannot pause messages")

    def resume_messages(self, selector: Selector) -> dict[str, Any]:
        """Release the selected paused messages to their due times (those past due at once); reports like `cancel`,
        with `resumed`."""
        raise NotImplementedError(f"{type(self).__name__} cannot resume messages")

    # -- the delivery history (core/history.py) ------------------------------------------------------
    #: Days of history kept (0: none is written).
    history_days: int = 0

    def delivery_history(self, destination: str | None = None, message_id: str | None = None,
                         outcome: str | None = None, since: datetime | None = None, before: datetime | None = None,
                         limit: int = 50, after: str | None = None) -> HistoryPage:
        """A page of history entries, newest first (a message's, oldest first), from the `next` cursor `after` of
        the page before; none where no history is kept."""
        return HistoryPage([])

    def history_chart(self, destination: str | None, since: datetime, until: datetime) -> list[dict[str, Any]]:
        """Per minute from `since` to `until`, of one destination or all (core.history.minute_series)."""
        return []

    def message_story(self, message_id: str, body_bytes: int | None = None) -> dict[str, Any]:
        """Where a message is and what became of each attempt (core.history.story_report); its body cut to
        `body_bytes` while still stored (None: left out, for readers who may not see bodies)."""
        page = self.browse(Selector(message_ids=(message_id,)), limit=1, body_bytes=body_bytes)["messages"]
        return story_report(message_id, page[0] if page else None,
                            self.delivery_history(message_id=message_id, limit=1000).entries, self.history_days)

    def register_destinations(self, destinations: Collection[str]) -> None:
        """Make destinations known before anything is sent to them (provisioning does)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no destinations")

    def destinations(self) -> dict[str, dict[str, Any]]:
        """Every known destination: `{name: {"paused": bool, "paused_at": iso or None}}`."""
        raise NotImplementedError(f"{type(self).__name__} keeps no destinations")

    def check_known(self, destinations: Collection[str]) -> None:
        """Raise UnknownDestinationError naming destinations never provisioned nor sent to."""
        raise NotImplementedError(f"{type(self).__name__} keeps no destinations")

    def set_paused(self, destinations: Collection[str], paused: bool) -> dict[str, list[str]]:
        """Pause or resume known destinations (claims leave paused ones stored): `{"changed", "unchanged"}`."""
        raise NotImplementedError(f"{type(self).__name__} cannot pause destinations")

    def forget_destinations(self, destinations: Collection[str], force: bool = False) -> dict[str, Any]:
        """Forget known destinations: no longer listed, known or paused, their settings gone. Refused while they
        have scheduled messages unless `force` (which purges them): `{"forgotten", "purged"}`."""
        raise NotImplementedError(f"{type(self).__name__} cannot forget destinations")


@dataclass(frozen=True)
class ReceivedMessage:
    message_id: str
    destination: str
    body: bytes
    headers: dict[str, str]
    receipt: Any
    enqueued_at: datetime
    due_at: datetime | None = None
    receive_count: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


class HeldMessage(NamedTuple):
    """A message a transport was holding until due, taken by take_held(): `message` is None when it
    cannot be read back (no id, destination or due time: poison); `receipt` settles it."""

    message: DelayedMessage | None
    receipt: Any


class Transport(ABC):
    """Where due messages go. One module per broker implements this."""

    name: str = "transport"
    #: Set by use_clock(); None: this host's clock.
    _clock: Callable[[], datetime] | None = None

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> Transport:
        """Build the transport from the plain data its hook's `transport_spec()` gives, in a process without
        Airflow (a Spark executor, the CLI). A transport the registry lists must implement it."""
        raise NotImplementedError(f"{cls.__name__} cannot be built from a connection spec: implement from_spec")

    def use_clock(self, clock: Callable[[], datetime]) -> Transport:
        """Compute remaining delays on `clock`: the store's, on which the due times handed to send() are kept
        (the pump and the send operator pass it). Returns self."""
        self._clock = clock
        return self

    def clock(self) -> datetime:
        """Now, on the clock that due times are compared with: the one given to use_clock(), else this host's."""
        return self._clock() if self._clock is not None else datetime.now(UTC)

    @property
    def where(self) -> str:
        """Where the transport's queues are, for messages and logs (never with a password)."""
        return repr(self)

    def upkeep(self) -> None:  # noqa: B027 - optional: a broker looks after its own queues
        """Look after the queues' tables if it is time (as DelayedMessageStore.upkeep): called by pumps between
        batches, so it must return at once. Nothing to do by default."""

    def check_ready(self) -> None:  # noqa: B027 - optional: a broker's queues are declared by provisioning
        """Raise StoreNotReadyError (saying what to run) while the transport's own tables are not there (as
        DelayedMessageStore.check_ready): called before each claim, so it must be cheap once they are."""

    def check_endpoint(self, endpoint: str, **options: Any) -> str:
        """The endpoint's name if this transport can create it; otherwise an error saying the rule.
        Provisioning checks every endpoint first, so a bad name creates nothing."""
        return check_destination(endpoint)

    @abstractmethod
    def provision(self, endpoint: str) -> dict[str, Any]:
        """Create what `endpoint` needs to receive messages (idempotent); returns what was declared or found."""

    @abstractmethod
    def send(self, messages: Sequence[DelayedMessage], connection: Any = None) -> dict[str, Exception]:
        """Send a batch; returns the failures by message id (empty: all sent).

        Raises when the whole batch could not be sent (broker unreachable). `connection` is the
        store's open transaction, given only when `joins(store)` said so.
        """

    @abstractmethod
    def receive(self, endpoint: str, max_messages: int = 10, visibility_timeout: float = 30.0) -> list[ReceivedMessage]:
        """Take up to `max_messages` visible messages; they stay hidden for `visibility_timeout` until acked."""

    @abstractmethod
    def ack(self, endpoint: str, receipts: Iterable[Any]) -> int:
        """Delete received messages; returns how many were deleted."""

    @abstractmethod
    def depth(self, endpoint: str) -> dict[str, int]:
        """The endpoint queue's messages by state: always `visible` (ready to receive), and where the
        broker tells, `in_flight` (received, not acked) and `scheduled` (delayed). Raises
        DestinationNotFoundError when the queue does not exist."""

    #: True when send_start() really overlaps: the pump then keeps one batch in flight while it claims the next.
    pipelined: bool = False
    #: True when the broker holds a message until its due time itself (its own delays): a send task hands
    #: messages to it at once. False: they are kept in the store until a dispatch task sends them when due.
    delays_natively: bool = False

    def send_start(
        self, messages: Sequence[DelayedMessage], connection: Any = None
    ) -> Callable[[], dict[str, Exception]]:
        """Start sending a batch; the returned function waits and gives the failures, like send().

        Transports that keep several batches in flight override this; by default it sends at once.
        """
        failures = self.send(messages, connection=connection)
        return lambda: failures

    def verify(self, endpoints: Iterable[str] = ()) -> dict[str, Any]:
        """Report, changing nothing, what provisioning `endpoints` would create or fix: a dict with
        `complete` (bool), `missing` and `different` (lists of names), and transport-specific details."""
        raise InvalidInputError(f"verify is not supported by transport {self.name!r}")

    def describe_delay(self, seconds: int, destination: str | None = None) -> str | None:
        """How this transport carries a delay of `seconds` to `destination` natively (and what it costs), for the
        send task's log; None when there is nothing worth saying."""
        return None

    def check_delay(self, message: DelayedMessage, seconds: int) -> None:  # noqa: B027 - no limit by default
        """Raise DelayError (saying what would allow it) when this transport cannot carry `message` natively for
        `seconds`; called for every message of a native send before any is sent. No limit by default."""

    #: True when the transport holds not-yet-due messages itself (native delays) and can hand them back:
    #: take_held(), then ack_held(), poison_held() or release_held() for each one taken.
    can_take_back: bool = False

    def take_held(self, max_messages: int) -> list[HeldMessage]:
        """Take up to `max_messages` messages still waiting for their due time; empty when none is left.

        They stay hidden from every reader until settled; unsettled ones go back to waiting when the
        transport closes (or its connection drops), so a crash loses none of them.
        """
        raise NotImplementedError(f"transport {self.name!r} cannot take back held messages")

    def ack_held(self, receipts: Iterable[Any]) -> int:
        """Delete taken messages, once they are safe elsewhere; returns how many were deleted."""
        raise NotImplementedError(f"transport {self.name!r} cannot take back held messages")

    def poison_held(self, receipts: Iterable[Any]) -> int:
        """Move taken messages, as they are, to the transport's poison queue; returns how many moved."""
        raise NotImplementedError(f"transport {self.name!r} cannot take back held messages")

    def release_held(self, receipts: Iterable[Any]) -> None:
        """Put taken messages back to wait for their due time, as if never taken."""
        raise NotImplementedError(f"transport {self.name!r} cannot take back held messages")

    #: True when peek() can show a queue's messages without consuming them (nor counting a delivery).
    can_peek: bool = False

    def peek(self, endpoint: str, max_messages: int = 10) -> list[ReceivedMessage]:
        """Up to `max_messages` visible messages of `endpoint`, left where they are: still visible to
        every reader, not counted as a delivery (a queue's delivery limit is never brought closer), their
        `receipt` None (nothing to settle). Raises NotImplementedError, saying why, where the broker
        cannot show a message without counting a delivery."""
        raise NotImplementedError(f"transport {self.name!r} cannot show messages without receiving them")

    def joins(self, store: DelayedMessageStore) -> bool:
        """True when sends can run inside the store's transaction, making dispatch exactly once."""
        return False

    def moves_from(self, store: DelayedMessageStore) -> bool:
        """True when `move_due` can move the store's due messages into this transport's queues itself, inside
        the store's database (no message passes through the pump)."""
        return False

    def move_due(self, store: DelayedMessageStore, now: datetime, limit: int, due_before: datetime | None = None,
                 exclude: Collection[str] = ()) -> list[tuple[str, datetime, int]]:
        """Move up to `limit` of the store's messages due at `now` (not those of `exclude`), to destinations
        this transport has, in one transaction: exactly once. Returns (destination, due time, how many) for
        the moved messages, grouped by destination and due time; messages to other destinations stay for the
        pump's claims (which dead-letter them)."""
        raise NotImplementedError(f"transport {self.name!r} cannot move messages inside the store")

    def close(self) -> None:  # noqa: B027 - optional: a transport without connections has nothing to release
        """Release connections."""

"""A reference model of what a delayed-message store promises, in plain Python: the stateful test
(tests/integration/test_store_model.py) holds every store to it after each step.

Times are integer microseconds on the store's clock. The model keeps what must be stored, which ids must be
refused, and which messages a claim at a given moment may take and must take:

- an id is refused while a message with it is stored, and for `window_us` after it was accepted; a duplicate send
  changes a stored message no live lease holds as its `on_duplicate` mode says (replace, keep the earliest, replace
  the body), which is a new acceptance;
- a claim never takes a message before its due time, nor one of a paused destination or one a sweep holds under
  a live lease, and never one twice;
- a pump that drains takes every message it may take (`must_take`); on a store in partitions (PostgreSQL) that
  holds for a message once a move has run since it was written (or its sweep's lease ran out) and it came within
  reach of that move, or once claims read every partition (`CLEAR_US` after the last move): the move runs every
  `MOVE_EVERY_SECONDS` in a pump's process, so this is "on time, give or take one move";
- a failed delivery is retried `retry_us` later, up to `num_retries` times, then dead-lettered;
- cancel, reschedule, purge and forget change only what no live lease holds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from airflow_delay_provider.stores.tables import SOON_US
from airflow_delay_provider.stores.tiers import CLEAR_US


@dataclass
class Stored:
    destination: str
    due_us: int
    failures: int = 0
    body: bytes = b"x"
    #: The sweep that leased it (its lease may have run out).
    claim: str | None = None
    #: Since when the store has had it as it is now (written, retried, rescheduled, released, resumed): a move after
    #: this takes it to where claims read.
    since_us: int = 0
    #: Paused by `pause_messages` until resumed: never claimed, swept or read as the next due time.
    held: bool = False


@dataclass
class Sweep:
    lease_until_us: int
    running: bool = True


@dataclass
class StoreModel:
    window_us: int
    num_retries: int
    retry_us: int
    #: The store keeps its messages in partitions that a move keeps (PostgreSQL, schema version 8 on).
    tiered: bool
    stored: dict[str, Stored] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)  # id -> when accepted
    known: set[str] = field(default_factory=set)
    paused: set[str] = field(default_factory=set)
    sweeps: dict[str, Sweep] = field(default_factory=dict)
    moves: list[int] = field(default_factory=list)  # when the move ran
    delivered: dict[str, int] = field(default_factory=dict)  # id -> how many times delivered (re-sent ids again)
    dead: dict[str, str] = field(default_factory=dict)  # id -> the destination it failed for
    #: The delivery history the store must have kept: (id, outcome, attempts) -> how many times.
    history: Counter[tuple[str, str, int]] = field(default_factory=Counter)

    # -- storing ---------------------------------------------------------------------------------------
    def refused(self, message_id: str, now_us: int) -> bool:
        seen = self.accepted.get(message_id)
        return message_id in self.stored or (seen is not None and seen >= now_us - self.window_us)

    def store(self, items: Iterable[tuple], now_us: int, mode: str = "skip") -> int:
        """Store (id, destination, due[, body]) items as one send, the duplicates as `mode` says (an id twice in the
        batch is two sends in a row); returns how many were stored or changed."""
        batch: dict[str, tuple[str, int, bytes]] = {}
        for message_id, destination, due_us, *body in items:
            new = (destination, due_us, body[0] if body else b"x")
            held = batch.get(message_id)
            batch[message_id] = new if held is None else self._duplicate(held, new, mode) or held
        new_ids = [i for i in batch if not self.refused(i, now_us)]
        changed = []
        for message_id, (destination, due_us, body) in batch.items():
            m = self.stored.get(message_id)
            if m is None or not self.unleased(m, now_us):
                continue
            after = self._duplicate((m.destination, m.due_us, m.body), (destination, due_us, body), mode)
            if after is not None:
                failures = 0 if mode != "replace_body" else m.failures
                m.destination, m.due_us, m.body, m.failures, m.since_us = *after, failures, now_us
                changed.append(message_id)
        for message_id in new_ids:
            destination, due_us, body = batch[message_id]
            self.stored[message_id] = Stored(destination, due_us, body=body, since_us=now_us)
        if self.window_us > 0:
            self.accepted.update((i, now_us) for i in [*new_ids, *changed])
        if new_ids or changed:
            self.known.update(d for _, d, *_ in items)
        return len(new_ids) + len(changed)

    @staticmethod
    def _duplicate(held: tuple[str, int, bytes], new: tuple[str, int, bytes], mode: str) -> tuple | None:
        """(destination, due, body) of a stored message after a duplicate send in `mode`, or None: unchanged."""
        if mode == "replace" or (mode == "keep_earliest" and new[1] < held[1]):
            return new
        if mode == "replace_body":
            return held[0], held[1], new[2]
        return None

    # -- claiming --------------------------------------------------------------------------------------
    def live(self, claim: str | None, now_us: int) -> bool:
        sweep = self.sweeps.get(claim) if claim is not None else None
        return sweep is not None and sweep.lease_until_us >= now_us

    def unleased(self, m: Stored, now_us: int) -> bool:
        return not self.live(m.claim, now_us)

    def claimable(self, now_us: int) -> dict[str, Stored]:
        """What a claim at `now_us` may take."""
        return {i: m for i, m in self.stored.items()
                if m.due_us <= now_us and m.destination not in self.paused and not m.held and self.unleased(m, now_us)}

    def since(self, m: Stored) -> int:
        """Since when `m` is as the store has it, for a move: a lease that ran out makes its rows claimable then."""
        if m.claim is not None and m.claim in self.sweeps:
            return max(m.since_us, self.sweeps[m.claim].lease_until_us + 1)
        return m.since_us

    def must_take(self, now_us: int) -> dict[str, Stored]:
        """What a pump draining at `now_us` must take."""
        may = self.claimable(now_us)
        # Claims read every partition where there are none, where this store object never moved (it has never
        # looked at `_later`), and once `CLEAR_US` has passed since its last look.
        if not self.tiered or not self.moves or now_us >= self.moves[-1] + CLEAR_US:
            return may
        return {i: m for i, m in may.items() if self._moved(m)}

    def _moved(self, m: Stored) -> bool:
        """Whether a move has run since `m` came to be as it is, with `m` within its reach: a move takes a row
        due within `SOON_US` into `_soon`, and its look sees a sweep's rows due within `CLEAR_US`."""
        since = self.since(m)
        reach = CLEAR_US if m.claim is not None else SOON_US
        return any(at >= since and m.due_us < at + reach for at in self.moves)

    def earliest(self, now_us: int) -> int | None:
        """The next due time a pump reads: of what a claim could take now or later."""
        dues = [m.due_us for m in self.stored.values() if m.destination not in self.paused and not m.held
                and self.unleased(m, now_us)]
        return min(dues, default=None)

    def settle(self, delivered: Iterable[str], refused: Iterable[str], now_us: int) -> set[str]:
        """What a pump did with what it took; returns the ids that must have been dead-lettered."""
        for message_id in delivered:
            self.history[message_id, "delivered", self.stored.pop(message_id).failures + 1] += 1
            self.delivered[message_id] = self.delivered.get(message_id, 0) + 1
        dead = set()
        for message_id in refused:
            m = self.stored[message_id]
            m.failures += 1
            m.claim = None  # a sweep's retry leaves the sweep
            if m.failures > self.num_retries:
                del self.stored[message_id]
                self.dead[message_id] = m.destination
                dead.add(message_id)
                self.history[message_id, "dead_lettered", m.failures] += 1
            else:
                m.due_us, m.since_us = now_us + self.retry_us, now_us
                self.history[message_id, "retried", m.failures] += 1
        return dead

    # -- sweeps ----------------------------------------------------------------------------------------
    def start_sweep(self, claim: str, due_before_us: int, lease_us: int, now_us: int) -> int:
        taken = [m for m in self.stored.values() if m.due_us <= now_us and m.due_us < due_before_us
                 and m.destination not in self.paused and not m.held and self.unleased(m, now_us)]
        self.sweeps[claim] = Sweep(now_us + lease_us)
        for m in taken:
            m.claim = claim
        return len(taken)

    def held_by(self, claim: str) -> dict[str, Stored]:
        return {i: m for i, m in self.stored.items() if m.claim == claim}

    def finish_sweep(self, claim: str, now_us: int) -> int:
        released = 0
        for m in self.stored.values():
            if m.claim == claim:
                m.claim, m.since_us = None, now_us
                released += 1
        self.sweeps[claim] = Sweep(0, running=False)
        return released

    def renew(self, claim: str, lease_us: int, now_us: int) -> bool:
        sweep = self.sweeps[claim]
        if not sweep.running:
            return False
        sweep.lease_until_us = now_us + lease_us
        return True

    # -- the backlog -----------------------------------------------------------------------------------
    def _selected(self, ids: Iterable[str] | None, destination: str | None, now_us: int) -> tuple[list[str], list[str]]:
        """(changeable, in flight) of a selection by ids or destination."""
        chosen = [i for i, m in self.stored.items() if (ids is None or i in ids)
                  and (destination is None or m.destination == destination)]
        busy = [i for i in chosen if not self.unleased(self.stored[i], now_us)]
        return [i for i in chosen if i not in busy], busy

    def cancel(self, ids: Iterable[str] | None, destination: str | None, now_us: int) -> tuple[set[str], set[str]]:
        changed, busy = self._selected(None if ids is None else set(ids), destination, now_us)
        for i in changed:
            self.history[i, "cancelled", self.stored.pop(i).failures] += 1
        return set(changed), set(busy)

    def reschedule(self, ids: Iterable[str] | None, destination: str | None, due_us: int,
                   now_us: int) -> tuple[set[str], set[str]]:
        due_us = max(due_us, now_us)
        changed, busy = self._selected(None if ids is None else set(ids), destination, now_us)
        for i in changed:
            m = self.stored[i]
            if m.due_us != due_us:
                m.due_us, m.since_us = due_us, now_us
        return set(changed), set(busy)

    def hold(self, ids: Iterable[str] | None, destination: str | None, pause: bool,
             now_us: int) -> tuple[set[str], set[str]]:
        """Pause (or resume) a selection: (reported paused or resumed, in flight). By ids, one already so is reported
        too; by a filter, only those changed. A resumed row goes to the partition of its due time then."""
        changed, busy = self._selected(None if ids is None else set(ids), destination, now_us)
        if not pause:  # a paused message is never leased: a resume takes every one selected
            changed, busy = changed + busy, []
        flipped = {i for i in changed if self.stored[i].held != pause}
        for i in flipped:
            m = self.stored[i]
            m.held = pause
            if not pause:
                m.since_us = now_us
        return (set(changed) if ids is not None else flipped), set(busy)

    def forget(self, destination: str, force: bool, now_us: int) -> bool:
        """Whether forgetting is allowed; forgets (purging with `force`) when it is."""
        mine = [i for i, m in self.stored.items() if m.destination == destination]
        if any(not self.unleased(self.stored[i], now_us) for i in mine) or (mine and not force):
            return False
        for i in mine:  # purged: cancelled
            self.history[i, "cancelled", self.stored.pop(i).failures] += 1
        self.known.discard(destination)
        self.paused.discard(destination)
        return True

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self.stored.values():
            out[m.destination] = out.get(m.destination, 0) + 1
        return out

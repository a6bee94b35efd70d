"""Every store held to the model of what a store promises (tests/store_model.py), by Hypothesis: random sequences of
sends, pumps, sweeps, backlog actions, moves between partitions and steps of a clock the test controls, checked
after every step against the model: what is stored (once per id), what was delivered (never early, never twice,
everything that was due), what was dead-lettered; and on PostgreSQL that each row no sweep holds is in the
partition of its due time (as written, or as the moves since took it).

The clock is the store's clock port (the database's clock on PostgreSQL) and the monotonic time of the store's and
the pump's modules, moved only by the test: sequences cross turns of the hour, the move's reach, the read-ahead
window, the de-duplication window and the partitions' rest in milliseconds. The move between partitions, which a
pump's process runs every few seconds in a thread, runs here as a step of its own.

`make test` runs a bounded number of examples per store; `make test-deep` many more (STORE_MODEL_EXAMPLES). A
failing sequence that was found is kept below as a regression test of its own, written out as Hypothesis shrank it.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections import Counter
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import delete, null, select, text

from airflow_delay_provider.core import progress
from airflow_delay_provider.core import pump as pump_module
from airflow_delay_provider.core.backlog import Selector
from airflow_delay_provider.core.duplicates import ON_DUPLICATE_MODES
from airflow_delay_provider.core.errors import CriticalError, InvalidInputError, UnknownDestinationError
from airflow_delay_provider.core.message import HEADER_FAILED_DESTINATION, DelayedMessage
from airflow_delay_provider.core.ports import Transport
from airflow_delay_provider.core.pump import Pump, PumpConfig
from airflow_delay_provider.core.retry_policy import DeliveryPolicy
from airflow_delay_provider.stores import counts, dedup, engine, sql, tiers, upkeep
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore, from_us, to_us
from airflow_delay_provider.stores.tables import HELD, HELD_VERSION, LATER, SOON, hour_tier, tier_of
from airflow_delay_provider.testing.store import InMemoryStore
from tests.conftest import PG_URL
from tests.helpers import ClockedStore, HeldClock
from tests.store_model import StoreModel

T0 = HeldClock.START  # a turn of the hour within the first steps
IDS = [f"m{i}" for i in range(6)]
BODIES = [b"x", b"y"]
DESTINATIONS = ["a", "b"]
ERROR = "error"
RETRY_SECONDS = 3
POLICY = DeliveryPolicy(min_delay_target=RETRY_SECONDS, max_delay_target=RETRY_SECONDS, num_retries=2)
#: Delays of sends and reschedules (seconds): past, now, within the move's reach, past it, the hours' partitions,
#: beyond them (`_far`).
DELAYS = [-5, 0, 1, 3, 29, 31, 59, 61, 300, 3_500, 3_700, 7_200, 100_000, 200_000]
STEPS = [0.001, 0.5, 1, 3, 5, 10, 29, 31, 59, 61, 300, 1_800, 3_600, 90_000]
EXAMPLES = {"memory": 200, "sqlite": 60, "postgres": 100, "upgrade": 20}


def _examples(kind: str) -> int:
    deep = os.environ.get("STORE_MODEL_EXAMPLES")
    return int(deep) if deep else EXAMPLES[kind]


class RecordingTransport(Transport):
    """Records what pumps send, refusing the ids in `refused` (any destination but the error queue's)."""

    name = "recording"

    def __init__(self) -> None:
        self.refused: set[str] = set()
        self.sent: list[DelayedMessage] = []
        self.failed: list[DelayedMessage] = []

    def provision(self, endpoint: str) -> dict:
        return {}

    def send(self, messages, connection=None) -> dict[str, Exception]:
        failures: dict[str, Exception] = {}
        for m in messages:
            if m.destination != ERROR and m.message_id in self.refused:
                failures[m.message_id] = RuntimeError("refused by the test's transport")
                self.failed.append(m)
            else:
                self.sent.append(m)
        return failures

    def receive(self, endpoint, max_messages=10, visibility_timeout=30.0):
        return []

    def ack(self, endpoint, receipts) -> int:
        return 0

    def depth(self, endpoint) -> dict[str, int]:
        return {"visible": 0}

    def take(self) -> tuple[list[DelayedMessage], list[DelayedMessage]]:
        sent, failed, self.sent, self.failed = self.sent, self.failed, [], []
        return sent, failed


def _pump(store, transport: RecordingTransport, clock: HeldClock, batch_size: int = 3) -> Pump:
    return clock.hold_breakers(Pump(store, transport, PumpConfig(
        batch_size=batch_size, first_batch_size=1, error_queue=ERROR, retry_jitter=0), policy=POLICY))


class Stores:
    """Where each kind of store of one test lives: a table made once, emptied before each example."""

    def __init__(self, kind: str, clock: HeldClock, tmp_path, pg_schema: str | None) -> None:
        self.kind, self.clock = kind, clock
        self.table = f"m_{uuid.uuid4().hex[:10]}"
        self.url = (PG_URL if kind in ("postgres", "upgrade") else f"sqlite:///{tmp_path / 'model.db'}")
        self.schema = pg_schema if kind in ("postgres", "upgrade") else None
        self.made = False

    def new(self, window: float, version: int | None = None):
        """A store object on emptied tables (with `version`, on a new table of that schema version)."""
        if self.kind == "memory":  # the longest retention: a run's clock may pass weeks
            return InMemoryStore(clock=self.clock.clock, dedup_window_seconds=window, history_days=90)
        if version is not None:
            self.table = f"m_{uuid.uuid4().hex[:10]}"
        store = ClockedStore(self.url, table=self.table, schema=self.schema, dedup_window_seconds=window,
                             local_clock=self.clock.clock, history_days=90)
        if version is not None:
            store.migrate(up_to=version)
            return store
        if not self.made:
            store.create_schema()
            self.made = True
            return store
        tables = [*(t for t in store.tables.of_store() if t is not store.tables.counts or store.is_postgres),
                  store.history.table]
        with store.engine.begin() as conn:
            if store.is_postgres:
                conn.execute(text("TRUNCATE " + ", ".join(store.qualified(t.name) for t in tables)))
            else:
                for t in tables:
                    conn.execute(delete(t))
        return store


class StoreMachine(RuleBasedStateMachine):
    """One store, one pump, sweeps and the backlog's actions against the model, on the test's clock."""

    stores: Stores  # set by the test

    def __init__(self) -> None:
        super().__init__()
        self.clock = self.stores.clock
        self.clock.now = T0
        self.transport = RecordingTransport()
        self.sweep_count = 0
        self.store = None
        self.model: StoreModel | None = None
        self.can_hold = False

    # -- set-up --------------------------------------------------------------------------------------
    @initialize(window=st.sampled_from([0, 5, 86_400]))
    def open_store(self, window: int) -> None:
        self.start(window)

    def start(self, window: int, version: int | None = None) -> None:
        self.store = self.stores.new(window, version)
        tiered = self.sql and self.store.is_postgres and self.store.tiered()
        self.model = StoreModel(window_us=window * 1_000_000, num_retries=POLICY.num_retries,
                                retry_us=RETRY_SECONDS * 1_000_000, tiered=tiered)
        self.pump = _pump(self.store, self.transport, self.clock)
        # Whether it can pause messages: a store of schema version 14 on (one upgraded by another process meanwhile
        # is paused only once every pump runs a release that knows it: not here).
        self.can_hold = not self.sql or self.store.schema_version() >= HELD_VERSION

    @property
    def sql(self) -> bool:
        return isinstance(self.store, SqlDelayedMessageStore)

    @property
    def now_us(self) -> int:
        return to_us(self.clock.now)

    # -- the clock -----------------------------------------------------------------------------------
    @rule(seconds=st.sampled_from(STEPS))
    def advance(self, seconds: float) -> None:
        self.clock.now += timedelta(seconds=seconds)

    @rule(offset=st.sampled_from([-61, -31, -1, 0, 1, 31]))
    def to_the_turn_of_the_hour(self, offset: int) -> None:
        turn = self.clock.now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
        self.clock.now = max(self.clock.now, turn + timedelta(seconds=offset))

    # -- sending -------------------------------------------------------------------------------------
    @rule(items=st.lists(st.tuples(st.sampled_from(IDS), st.sampled_from(DESTINATIONS), st.sampled_from(DELAYS),
                                   st.sampled_from(BODIES)), min_size=1, max_size=3),
          on_duplicate=st.sampled_from(ON_DUPLICATE_MODES))
    def send(self, items, on_duplicate: str = "skip") -> None:
        now = self.clock.now
        messages = [DelayedMessage(d, body, now + timedelta(seconds=s), message_id=i) for i, d, s, *b in items
                    for body in [b[0] if b else b"x"]]
        expected = self.model.store([(m.message_id, m.destination, to_us(m.due_at), m.body) for m in messages],
                                    self.now_us, on_duplicate)
        assert self.store.store(messages, on_duplicate=on_duplicate) == expected

    # -- moving and pumping ----------------------------------------------------------------------------
    @precondition(lambda self: self.model.tiered)
    @rule()
    def move(self) -> None:
        self.store.later.run()
        self.model.moves.append(self.now_us)

    @rule()
    def drain(self) -> None:
        """The pump takes everything it may, as its loop does (a claim, and again after reading the next due time
        while anything is left)."""
        must = set(self.model.must_take(self.now_us))
        taken = self._pumped(self.pump, lambda: [self.pump.run(stop_when_idle=True) for _ in range(3)])
        assert must <= taken, f"due and not taken by the pump: {sorted(must - taken)}"

    @rule(limit=st.integers(1, 3))
    def one_batch(self, limit: int) -> None:
        self._pumped(self.pump, lambda: self.pump.dispatch_batch(limit))

    def _pumped(self, pump: Pump, run, held_by: str | None = None) -> set[str]:
        """Run `run` (a pump's work) and settle the model with what was sent; returns the ids taken."""
        may = self.model.held_by(held_by) if held_by else self.model.claimable(self.now_us)
        try:
            run()
        except CriticalError as exc:
            # Only an outage may stop a pump, and here nothing is down: every drain ends with nothing left to send
            # now (what failed is due again later), so no failure lasts (a transport failing every message of a
            # backlog for 30 s still trips it: tests/unit/core/test_pump.py).
            raise AssertionError(f"the pump stopped itself: {exc}") from exc
        sent, failed = self.transport.take()
        delivered = [m.message_id for m in sent if m.destination != ERROR]
        dead = {m.message_id: m.headers.get(HEADER_FAILED_DESTINATION) for m in sent if m.destination == ERROR}
        refused = [m.message_id for m in failed]
        taken = delivered + refused
        assert len(set(taken)) == len(taken), f"taken twice in one step: {sorted(taken)}"
        assert not set(taken) - set(may), f"taken though not due, paused or leased: {sorted(set(taken) - set(may))}"
        for m in [*sent, *failed]:
            if m.destination != ERROR:
                assert m.due_at <= self.clock.now, f"{m.message_id} sent before its due time"
        expected_dead = self.model.settle(delivered, refused, self.now_us)
        assert set(dead) == expected_dead, f"dead-lettered {sorted(dead)}, expected {sorted(expected_dead)}"
        assert all(dead[i] == self.model.dead[i] for i in dead)
        return set(taken)

    @rule(message_id=st.sampled_from(IDS), refuse=st.booleans())
    def refuse(self, message_id: str, refuse: bool) -> None:
        (self.transport.refused.add if refuse else self.transport.refused.discard)(message_id)

    @rule()
    def next_due(self) -> None:
        expected = self.model.earliest(self.now_us)
        assert self.store.next_due() == (None if expected is None else from_us(expected))

    # -- sweeps (the SQL store) ----------------------------------------------------------------------------
    @precondition(lambda self: self.sql)
    @rule(before=st.sampled_from([-10, 1, 3_600]), lease=st.sampled_from([5, 60, 600]))
    def start_sweep(self, before: int, lease: int) -> None:
        self.sweep_count += 1
        claim = f"s{self.sweep_count}"
        due_before = self.clock.now + timedelta(seconds=before)
        expected = self.model.start_sweep(claim, to_us(due_before), lease * 1_000_000, self.now_us)
        assert self.store.start_sweep(claim, due_before, lease_seconds=lease)["claimed"] == expected

    def _running(self) -> list[str]:
        return [c for c, s in self.model.sweeps.items() if s.running]

    @precondition(lambda self: self.sql and self._running())
    @rule(data=st.data(), k=st.integers(1, 4))
    def sweep_step(self, data, k: int) -> None:
        self._sweep_rows(data.draw(st.sampled_from(self._running())), k)

    def _sweep_rows(self, claim: str, k: int) -> None:
        """A part of a sweep sends (up to) `k` of the rows it holds."""
        low, high, _ = self.store.claimed_range(claim)
        rows = list(self.store.read_claimed(claim, low, high))[:k]
        leased = self.store.leased_rows(claim, rows)
        pump = _pump(leased, self.transport, self.clock)
        self._pumped(pump, lambda: pump.run(stop_when_idle=True), held_by=claim)

    @precondition(lambda self: self.sql and self._running())
    @rule(data=st.data())
    def finish_sweep(self, data) -> None:
        self._finish(data.draw(st.sampled_from(self._running())))

    def _finish(self, claim: str) -> None:
        expected = self.model.finish_sweep(claim, self.now_us)
        assert self.store.finish_sweep(claim, "done", {}) == expected

    @precondition(lambda self: self.sql)
    @rule(refuse_all=st.booleans())
    def sweep(self, refuse_all: bool) -> None:
        """A whole sweep, as a sweep task runs one: lease what is due, send it (the transport refusing every message,
        or as it is), finish."""
        self.start_sweep(before=1, lease=600)
        claim = f"s{self.sweep_count}"
        refused, self.transport.refused = self.transport.refused, set(IDS) if refuse_all else self.transport.refused
        try:
            self._sweep_rows(claim, len(IDS))
        finally:
            self.transport.refused = refused
        self._finish(claim)

    @precondition(lambda self: self.sql and self.model.sweeps)
    @rule(data=st.data(), lease=st.sampled_from([5, 60]))
    def renew(self, data, lease: int) -> None:
        claim = data.draw(st.sampled_from(sorted(self.model.sweeps)))
        assert self.store.renew_lease(claim, lease) == self.model.renew(claim, lease * 1_000_000, self.now_us)

    # -- the backlog's actions --------------------------------------------------------------------------
    def _known_or_refused(self, destination: str, action) -> bool:
        """Run `action`; False (and checked refused) when the destination is not known to the store."""
        if destination in self.model.known:
            return True
        with pytest.raises(UnknownDestinationError):
            action()
        return False

    @rule(ids=st.sets(st.sampled_from(IDS), min_size=1, max_size=3))
    def cancel(self, ids) -> None:
        changed, busy = self.model.cancel(ids, None, self.now_us)
        report = self.store.cancel(Selector(message_ids=tuple(sorted(ids))))
        assert (set(report["cancelled"]), set(report["in_flight"])) == (changed, busy)

    @rule(destination=st.sampled_from(DESTINATIONS), purge=st.booleans())
    def cancel_destination(self, destination: str, purge: bool) -> None:
        def act():
            if purge:
                return self.store.purge(destination, dry_run=False)
            return self.store.cancel(Selector(destination=destination))

        if self._known_or_refused(destination, act):
            changed, busy = self.model.cancel(None, destination, self.now_us)
            report = act()
            counts = report.get("counts", report)
            assert (counts.get("cancelled", counts.get("purged")), counts["in_flight"]) == (len(changed), len(busy))

    @rule(ids=st.sets(st.sampled_from(IDS), min_size=1, max_size=3), delay=st.sampled_from([0, *DELAYS]))
    def reschedule(self, ids, delay: int) -> None:
        due = self.clock.now + timedelta(seconds=delay)
        changed, busy = self.model.reschedule(ids, None, to_us(due), self.now_us)
        report = self.store.reschedule(Selector(message_ids=tuple(sorted(ids))), due)
        assert (set(report["rescheduled"]), set(report["in_flight"])) == (changed, busy)

    @rule(destination=st.sampled_from(DESTINATIONS), paused=st.booleans())
    def pause(self, destination: str, paused: bool) -> None:
        if self._known_or_refused(destination, lambda: self.store.set_paused([destination], paused)):
            was = destination in self.model.paused
            (self.model.paused.add if paused else self.model.paused.discard)(destination)
            report = self.store.set_paused([destination], paused)
            assert report["changed"] == ([destination] if was != paused else [])

    @precondition(lambda self: self.can_hold)
    @rule(ids=st.sets(st.sampled_from(IDS), min_size=1, max_size=3), pause=st.booleans())
    def hold(self, ids, pause: bool) -> None:
        changed, busy = self.model.hold(ids, None, pause, self.now_us)
        selector = Selector(message_ids=tuple(sorted(ids)))
        report = self.store.pause_messages(selector) if pause else self.store.resume_messages(selector)
        key = "paused" if pause else "resumed"
        assert (set(report[key]), set(report["in_flight"])) == (changed, busy)

    @precondition(lambda self: self.can_hold)
    @rule(destination=st.sampled_from(DESTINATIONS), pause=st.booleans())
    def hold_destination(self, destination: str, pause: bool) -> None:
        selector = Selector(destination=destination)

        def act():
            return self.store.pause_messages(selector) if pause else self.store.resume_messages(selector)

        if self._known_or_refused(destination, act):
            changed, busy = self.model.hold(None, destination, pause, self.now_us)
            counts = act()["counts"]
            assert (counts["paused" if pause else "resumed"], counts["in_flight"]) == (len(changed), len(busy))

    @rule(destination=st.sampled_from(DESTINATIONS), force=st.booleans())
    def forget(self, destination: str, force: bool) -> None:
        if not self._known_or_refused(destination, lambda: self.store.forget_destinations([destination], force)):
            return
        if self.model.forget(destination, force, self.now_us):
            self.store.forget_destinations([destination], force)
        else:
            with pytest.raises(InvalidInputError):
                self.store.forget_destinations([destination], force)

    # -- after every step ---------------------------------------------------------------------------------
    @invariant()
    def agrees_with_the_model(self) -> None:
        if self.model is None:
            return
        rows = self._rows()
        twice = {i for i, found in rows.items() if len(found) > 1}
        assert not twice, f"stored more than once: {sorted(twice)}"
        have = {i: found[0] for i, found in rows.items()}
        want = {i: (m.destination, m.due_us, m.failures, m.claim if self.sql else None, m.body, m.held)
                for i, m in self.model.stored.items()}
        assert {i: (*row[:4], row[5], row[6]) for i, row in have.items()} == want
        assert self.store.count_scheduled() == self.model.counts()
        if self.keeps_history:
            kept = Counter((e.message_id, e.outcome, e.attempts)
                           for e in self.store.delivery_history(limit=1000).entries)
            assert kept == self.model.history, f"history {sorted(kept - self.model.history)} not in the model, " \
                                               f"{sorted(self.model.history - kept)} missing"
        if self.checks_partitions:
            misplaced = {i: (row[4], sorted(self._partitions(i))) for i, row in have.items()
                         if row[3] is None and row[4] not in self._partitions(i)}
            assert not misplaced, f"in the partition of another due time (found, allowed): {misplaced}"

    #: Whether the store keeps the delivery history from the start (not one of schema version 7).
    keeps_history = True

    @property
    def checks_partitions(self) -> bool:
        """Whether rows must be in the partition of their due time (stores/tiers.py): where the store object has
        known the partitions since its first row."""
        return self.model.tiered and self.store.is_postgres

    def _partitions(self, message_id: str) -> set[int]:
        """Where a row no sweep holds may be: the partition of its due time when it was written (sent, retried,
        rescheduled, released), or one the moves since could have taken it to."""
        m, ring = self.model.stored[message_id], self.store.ringed()
        if m.held:
            return {HELD}
        first, last = tier_of(m.due_us, m.since_us, ring), tier_of(m.due_us, self.now_us, ring)
        return {first, last, *([hour_tier(m.due_us)] if ring and first == LATER and last == SOON else [])}

    def _rows(self) -> dict[str, list[tuple]]:
        rows: dict[str, list[tuple]] = {}
        if not self.sql:
            for i, m in self.store._messages.items():
                rows.setdefault(i, []).append((m.destination, to_us(m.due_at), m.failures, None, None, m.body,
                                               i in self.store._holds))
            return rows
        t = self.store.table
        has_tier = self.store.schema_version() >= 8  # a store of schema version 7 has none
        tier = t.c.tier if has_tier else null()
        with self.store.engine.connect() as conn:
            for row in conn.execute(select(t.c.message_id, t.c.destination, t.c.due_at_us, t.c.failures,
                                           t.c.claim_id, tier, t.c.body)):
                rows.setdefault(row[0], []).append((*row[1:6], bytes(row[6]), row[5] == HELD))
        return rows


class UpgradingStoreMachine(StoreMachine):
    """A store of schema version 7 (one table), migrated to the partitions by another process while this one
    works on it."""

    checks_partitions = False  # rows written before this object saw the partitions go where it wrote them
    keeps_history = False  # none before the upgrade

    @initialize(window=st.sampled_from([0, 86_400]))
    def open_store(self, window: int) -> None:
        self.start(window, version=7)

    @precondition(lambda self: self.store.schema_version() < 9)
    @rule()
    def upgrade_elsewhere(self) -> None:
        other = SqlDelayedMessageStore(self.store.url, table=self.store.table_name, schema=self.store.schema)
        other.migrate()
        self.model.tiered = True  # claims read every partition until this process's first move


_TIMED = (engine, sql, tiers, dedup, counts, upkeep, pump_module, progress)


@pytest.fixture
def held_clock(monkeypatch) -> HeldClock:
    clock = HeldClock().install(monkeypatch, *_TIMED)
    # Thousands of sequences arm breakers and move rows: their lines would only slow the run down.
    package = logging.getLogger("airflow_delay_provider")
    level, package.level = package.level, logging.ERROR
    yield clock
    package.setLevel(level)


def _run(kind: str, machine: type[StoreMachine], held_clock: HeldClock, tmp_path, request) -> None:
    schema = request.getfixturevalue("pg_schema") if kind in ("postgres", "upgrade") else None
    machine.stores = Stores(kind, held_clock, tmp_path, schema)
    run_state_machine_as_test(machine, settings=settings(
        max_examples=_examples(kind), stateful_step_count=30, deadline=None, database=None,
        suppress_health_check=list(HealthCheck)))


@pytest.mark.parametrize("kind", ["memory", "sqlite", "postgres"])
def test_the_store_agrees_with_the_model(kind, held_clock, tmp_path, request):
    _run(kind, StoreMachine, held_clock, tmp_path, request)


def test_a_store_upgraded_by_another_process_meanwhile_agrees_with_the_model(held_clock, tmp_path, request):
    _run("upgrade", UpgradingStoreMachine, held_clock, tmp_path, request)


# -- sequences the machine found, as it shrank them: each failed before its fix ---------------------------------------
def _machine(kind: str, held_clock: HeldClock, tmp_path, request, window: int, machine=StoreMachine):
    schema = request.getfixturevalue("pg_schema") if kind in ("postgres", "upgrade") else None
    machine.stores = Stores(kind, held_clock, tmp_path, schema)
    state = machine()
    state.open_store(window=window)
    return state


def _steps(state: StoreMachine, *steps) -> None:
    """Run the rules in turn, checking the model after each, as the machine does."""
    state.agrees_with_the_model()
    for name, kwargs in steps:
        getattr(state, name)(**kwargs)
        state.agrees_with_the_model()
    state.teardown()


def test_found_a_message_refused_again_after_a_wait_stopped_the_pump(held_clock, tmp_path, request):
    state = _machine("memory", held_clock, tmp_path, request, window=0)
    _steps(state, ("send", {"items": [("m0", "a", -5)]}), ("refuse", {"message_id": "m0", "refuse": True}),
           ("drain", {}), ("advance", {"seconds": 31}), ("drain", {}))


def test_found_an_id_twice_in_one_send_was_stored_in_two_partitions(held_clock, tmp_path, request):
    state = _machine("postgres", held_clock, tmp_path, request, window=0)
    _steps(state, ("send", {"items": [("m0", "a", -5), ("m0", "a", 61)]}))


def test_found_a_refused_re_send_renewed_the_window(held_clock, tmp_path, request):
    state = _machine("sqlite", held_clock, tmp_path, request, window=5)
    _steps(state, ("send", {"items": [("m0", "a", -5)]}), ("advance", {"seconds": 300}),
           ("send", {"items": [("m0", "a", -5)]}), ("drain", {}), ("send", {"items": [("m0", "a", -5)]}))


def test_found_a_re_sent_id_was_stored_again_beside_its_stored_message(held_clock, tmp_path, request):
    state = _machine("postgres", held_clock, tmp_path, request, window=5)
    _steps(state, ("send", {"items": [("m0", "a", 100_000)]}), ("advance", {"seconds": 10}),
           ("send", {"items": [("m0", "a", 3_700)]}))


def test_found_a_message_made_due_now_kept_its_id_refused_until_its_old_due_time(held_clock, tmp_path, request):
    state = _machine("postgres", held_clock, tmp_path, request, window=0)
    _steps(state, ("send", {"items": [("m0", "a", 100_000)]}), ("reschedule", {"ids": {"m0"}, "delay": 0}),
           ("drain", {}), ("send", {"items": [("m0", "a", -5)]}))


def test_found_a_re_send_failed_on_a_store_migrated_to_partitions_meanwhile(held_clock, tmp_path, request):
    state = _machine("upgrade", held_clock, tmp_path, request, window=0, machine=UpgradingStoreMachine)
    _steps(state, ("upgrade_elsewhere", {}), ("send", {"items": [("m0", "a", -5), ("m0", "a", -5)]}))


def test_found_a_sweeps_retry_stayed_in_the_partition_of_its_old_due_time(held_clock, tmp_path, request):
    state = _machine("postgres", held_clock, tmp_path, request, window=0)
    _steps(state, ("send", {"items": [("m0", "a", 61)]}), ("advance", {"seconds": 61}),
           ("sweep", {"refuse_all": True}))


def test_found_two_failed_batches_an_hour_apart_stopped_the_pump(held_clock, tmp_path, request):
    """The pump's single batches an hour apart, with nothing tried in between: two failures, not an hour of them."""
    state = _machine("memory", held_clock, tmp_path, request, window=0)
    _steps(state, ("send", {"items": [("m0", "a", -5)]}), ("refuse", {"message_id": "m0", "refuse": True}),
           ("one_batch", {"limit": 1}), ("advance", {"seconds": 3_600}), ("one_batch", {"limit": 1}))

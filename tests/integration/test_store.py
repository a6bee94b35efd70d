"""The SQL store on SQLite and on the real PostgreSQL."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from sqlalchemy import inspect

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import InvalidNameError, UnavailableError
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore, to_us
from tests.helpers import make_store, messages


def test_schema_is_idempotent_with_due_index(db):
    url, schema, table = db
    store = make_store(url, schema, table)
    store.create_schema()  # twice: no error, nothing lost
    store.store(messages(3))
    store.create_schema()
    indexes = inspect(store.engine).get_indexes(table, schema=schema)
    assert any(ix["column_names"][0] == "due_at_us" for ix in indexes)
    assert sum(store.count_scheduled().values()) == 3


def test_fetch_due_oldest_first_within_window(db):
    store = make_store(*db)
    now = utcnow()
    dues = [now - timedelta(seconds=s) for s in (5, 30, 10, 1)] + [now + timedelta(hours=1)]
    store.store([DelayedMessage("q", b"", d, message_id=f"id{i}") for i, d in enumerate(dues)])
    with store.claim_due(now, 10) as claim:
        assert [m.message_id for m in claim.messages] == ["id1", "id2", "id0", "id3"]
    with store.claim_due(now, 2) as claim:
        assert [m.message_id for m in claim.messages] == ["id1", "id2"]
    # due_before is exclusive: a data interval [start, end) owns what is due before its end.
    with store.claim_due(now, 10, due_before=dues[2]) as claim:
        assert [m.message_id for m in claim.messages] == ["id1"]
    assert store.next_due() == min(dues)
    assert store.next_due(due_before=dues[1]) is None
    assert store.count_scheduled() == {"q": 5}
    assert store.count_scheduled(due_before=now) == {"q": 4}


def test_claim_settles_in_one_transaction(db):
    store = make_store(*db)
    store.store(messages(4))
    with pytest.raises(RuntimeError), store.claim_due(utcnow(), 10) as claim:
        claim.remove(["m-0", "m-1"])
        raise RuntimeError("crash after remove")
    assert store.count_scheduled() == {"orders": 4}  # the removal was rolled back
    later = utcnow() + timedelta(minutes=5)
    with store.claim_due(utcnow(), 10) as claim:
        claim.remove(["m-0"])
        claim.retry({"m-1": later})
    assert store.count_scheduled() == {"orders": 3}
    retried = store.get("m-1")
    assert retried.failures == 1 and abs((retried.due_at - later).total_seconds()) < 1e-3
    assert store.get("m-0") is None


def test_store_is_idempotent_by_message_id_and_keeps_fields(db):
    store = make_store(*db)
    batch = messages(5)
    assert store.store(batch) == 5
    assert store.store(batch + messages(2, start=5)) == 2
    assert sum(store.count_scheduled().values()) == 7
    got = store.get("m-3")
    assert (got.body, got.headers, got.destination) == (b"body-3", {"n": "3"}, "orders")


@pytest.mark.parametrize(
    "bad", ["orders; DROP TABLE x", "1abc", "", "a" * 64, 'x"y', "t-1", "ta ble", "tëst", None]
)
def test_bad_table_names_are_refused_before_any_sql(bad, tmp_path):
    with pytest.raises(InvalidNameError, match="letters, digits and underscores"):
        SqlDelayedMessageStore(f"sqlite:///{tmp_path / 'x.db'}", table=bad)
    with pytest.raises(InvalidNameError):
        SqlDelayedMessageStore(f"sqlite:///{tmp_path / 'x.db'}", schema=bad or "1")
    assert not (tmp_path / "x.db").exists()


def test_unreachable_database_gives_clear_error_without_password():
    store = SqlDelayedMessageStore("postgresql+psycopg://alice:s3cretPW@127.0.0.1:1/nodb", table="t")
    with pytest.raises(UnavailableError) as err:
        store.create_schema()
    text = str(err.value)
    assert "127.0.0.1:1" in text and "not reachable" in text
    assert "s3cretPW" not in text and "s3cretPW" not in repr(store)
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_concurrent_claims_skip_locked_rows(pg):
    store = make_store(*pg)
    store.store(messages(100))
    first_claimed, release = threading.Event(), threading.Event()
    seen: dict[str, list[str]] = {}

    def hold():
        with store.claim_due(utcnow(), 60) as claim:
            seen["a"] = [m.message_id for m in claim.messages]
            first_claimed.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert first_claimed.wait(10)
    with store.claim_due(utcnow(), 100) as claim:
        seen["b"] = [m.message_id for m in claim.messages]
    release.set()
    t.join()
    assert len(seen["a"]) == 60 and len(seen["b"]) == 40
    assert not set(seen["a"]) & set(seen["b"])


def test_table_names_leave_room_for_the_policies_and_sweeps_tables(db):
    url, schema, _ = db
    longest = "t" * 54
    store = make_store(url, schema, longest)  # 54 + "_policies" = 63: PostgreSQL's limit
    assert inspect(store.engine).has_table(f"{longest}_policies", schema=schema)
    with pytest.raises(InvalidNameError, match="at most 54.*_policies"):
        SqlDelayedMessageStore(url, table="t" * 55, schema=schema)


def test_an_unrelated_table_of_that_name_is_refused_and_left_alone(db):
    from sqlalchemy import Column, Integer, MetaData, Table

    from airflow_delay_provider.core.errors import InvalidInputError

    url, schema, table = db
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    other = Table(table, MetaData(), Column("order_id", Integer, primary_key=True), schema=schema)
    other.metadata.create_all(store.engine)
    with pytest.raises(InvalidInputError, match=r"not a delay store table \(missing columns \['body'"):
        store.create_schema()
    inspector = inspect(store.engine)
    assert [c["name"] for c in inspector.get_columns(table, schema=schema)] == ["order_id"]  # no ALTER
    assert not inspector.has_table(f"{table}_policies", schema=schema)  # nothing created beside it


def test_sqlite_store_syncs_every_commit(tmp_path):
    store = make_store(f"sqlite:///{tmp_path / 'store.db'}", None, "t")
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL: survives a power loss


def test_postgres_sessions_bound_what_a_vanished_pump_can_hold(pg):
    from sqlalchemy.engine import make_url

    from airflow_delay_provider.core.errors import InvalidInputError

    url, schema, table = pg
    store = make_store(url, schema, table)
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("SHOW idle_in_transaction_session_timeout").scalar() == "2min"
        assert conn.exec_driver_sql("SHOW lock_timeout").scalar() == "30s"
        assert conn.connection.driver_connection.info.get_parameters()["keepalives_idle"] == "30"  # client side
    tuned = make_url(url).update_query_dict({"idle_in_transaction_session_timeout": "5s", "lock_timeout": "500ms"})
    store = make_store(tuned, schema, table)
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("SHOW idle_in_transaction_session_timeout").scalar() == "5s"
        assert conn.exec_driver_sql("SHOW lock_timeout").scalar() == "500ms"
    with pytest.raises(InvalidInputError, match="lock_timeout must be a duration"):
        SqlDelayedMessageStore(make_url(url).update_query_dict({"lock_timeout": "1s -c work_mem=1GB"}), table=table)


def test_ids_are_not_accepted_twice_within_the_dedup_window(db):
    from airflow_delay_provider.core.pump import Pump
    from tests.helpers import drain, make_transport

    url, schema, table = db
    store = make_store(url, schema, table)
    queue = make_transport(url, schema, table, "orders", "error")
    assert store.store(messages(5, delay=-1)) == 5
    assert Pump(store, queue).run(stop_when_idle=True).stats.dispatched == 5  # delivered: gone from the store
    # A send retried after its messages were delivered stores none of them again.
    assert store.store(messages(5, delay=-1)) == 0
    assert store.store(messages(7, delay=-1)) == 2  # only the new ids
    assert len(drain(queue, "orders")) == 5
    # Native sends check and record the same ids.
    assert store.unseen(["m-1", "m-9", "n-1"]) == ["m-9", "n-1"]
    store.remember_sent(["n-1"])
    assert store.unseen(["n-1"]) == []
    # Past the window an id is accepted again; a window of 0 turns de-duplication off.
    short = SqlDelayedMessageStore(url, table=table, schema=schema, dedup_window_seconds=0.5)
    time.sleep(0.6)
    assert short.unseen(["m-1", "n-1"]) == ["m-1", "n-1"]
    assert short.store(messages(1, delay=-1)) == 1
    off = SqlDelayedMessageStore(url, table=table, schema=schema, dedup_window_seconds=0)
    assert off.store(messages(1, delay=-1, start=1)) == 1
    # A migration of messages accepted before bypasses the window (only stored ids are skipped).
    Pump(store, queue).run(stop_when_idle=True)
    assert store.store(messages(3, delay=60), deduplicate=False) == 3


def test_expired_ids_are_found_by_their_index_in_an_ids_table_never_analysed(pg):
    """The ids table takes only inserts for a window's length, so nothing may have analysed it yet: the expiry
    must still read its index, not the whole table (a full read once a minute of hundreds of millions of ids)."""
    from sqlalchemy import event

    url, schema, table = pg
    store = make_store(url, schema, table)
    assert store.store(messages(3000, delay=60)) == 3000
    ids = store.qualified(store.tables.ids.name)
    sent: list[tuple[str, object]] = []
    with store.engine.begin() as conn:
        assert conn.exec_driver_sql("SELECT reltuples FROM pg_class WHERE oid = to_regclass(%s)",
                                    (ids,)).scalar() < 0  # never vacuumed or analysed

        def record(_conn, _cursor, statement, parameters, *_) -> None:
            sent.append((statement, parameters))

        event.listen(conn, "before_cursor_execute", record)
        store.accepted._expired_at = -float("inf")  # due now
        store.accepted.expire(conn, to_us(store.clock()))
        event.remove(conn, "before_cursor_execute", record)
    # The same statements again, in one transaction, the DELETE explained: the plan it ran with.
    plans = []
    with store.engine.begin() as conn:
        for statement, parameters in sent:
            if "DELETE FROM" in statement.upper():  # the expiry (after the messages it keeps, as a WITH)
                plans.append("\n".join(row[0] for row in conn.exec_driver_sql(f"EXPLAIN {statement}", parameters)))
            else:
                conn.exec_driver_sql(statement, parameters)
    assert len(plans) == 1, sent
    assert "Seq Scan" not in plans[0] and "Index" in plans[0], plans[0]


def test_provisioning_from_several_tasks_at_once_creates_each_table_once(pg):
    import uuid

    from sqlalchemy import create_engine, text

    from tests.helpers import make_transport

    url, _, table = pg
    schema = f"adp_race_{uuid.uuid4().hex[:8]}"  # nothing created yet: every task races to create it all
    errors = []

    def provision(n):
        try:
            make_store(url, schema, table)
            make_transport(url, schema, "delay", f"q{n}", "error")
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=provision, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == []
        assert set(SqlDelayedMessageStore(url, table=table, schema=schema).count_scheduled()) == set()
    finally:
        engine = create_engine(url)
        with engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        engine.dispose()


def test_a_connection_lost_inside_a_transaction_is_reported_as_an_outage(pg):
    from sqlalchemy import text

    from airflow_delay_provider.core.errors import UnavailableError
    from airflow_delay_provider.stores.engine import translate_errors

    url, schema, table = pg
    store = make_store(url, schema, table)
    with store.engine.connect() as victim, store.engine.connect() as killer:
        victim.begin()
        pid = victim.execute(text("select pg_backend_pid()")).scalar()
        killer.execute(text("select pg_terminate_backend(:pid)"), {"pid": pid})
        with pytest.raises(UnavailableError, match="not reachable"), translate_errors(store.url, "claim"):
            victim.execute(text("select 1"))
        # SQLAlchemy refuses the connection until the transaction is rolled back: an outage, named as one.
        with pytest.raises(UnavailableError, match="was lost inside a transaction"), \
                translate_errors(store.url, "claim"):
            victim.execute(text("select 1"))
    store.close()


class _Clock:
    """A host clock that moves only when told to, `skew` seconds off the shared time."""

    def __init__(self, now, skew: float = 0.0) -> None:
        self.now, self.skew = now, skew

    def __call__(self):
        return self.now + timedelta(seconds=self.skew)


def test_pumps_whose_clocks_disagree_take_no_more_than_the_rate(db):
    """The throttle bucket is shared through the database: a take written with an older time than the last
    one must not move the bucket's time back, or the next take refills the same interval twice."""
    url, schema, table = db
    start = utcnow()
    ahead, behind = _Clock(start), _Clock(start)
    fast = SqlDelayedMessageStore(url, table=table, schema=schema, local_clock=ahead)
    slow = SqlDelayedMessageStore(url, table=table, schema=schema, local_clock=behind)
    fast.create_schema()
    # On PostgreSQL each store measures the database clock against its host's once: both start in step, then
    # one host's clock is 0.5 s ahead of the other's (as much as NTP can leave between two hosts).
    fast.clock(), slow.clock()
    ahead.skew = 0.5
    rate, capacity, step = 100.0, 100.0, 0.01
    taken = 0
    for i in range(200):  # 2 s, the two pumps taking turns every 10 ms, each wanting more than the bucket holds
        for clock in (ahead, behind):
            clock.now = start + timedelta(seconds=i * step)
        taken += (fast if i % 2 else slow).take_tokens("orders", rate, 1000)[0]
    elapsed = 199 * step
    # The clock ahead refills its 0.5 s once (within the capacity), never again on each of its turns.
    assert taken <= rate * elapsed + capacity, taken
    assert taken >= rate * elapsed  # nor is the rate starved

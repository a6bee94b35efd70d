"""The fault suite, against the real services: pumps killed with SIGKILL, connections cut, backends terminated,
the SQS relay killed mid-cycle. Nothing is lost or delivered early; duplicates stay within at-least-once
(none where the queue is a table in the store's database). `pytest -s` prints the counts."""

from __future__ import annotations

import time

import psycopg
import pytest
from sqlalchemy.engine import make_url

from tests.conftest import PG_URL
from tests.faults.proxy import TcpProxy
from tests.faults.scenarios import FaultCounts, markdown_table, pump_faults, sqs_relay_faults

RESULTS: list[FaultCounts] = []


@pytest.fixture
def tcp_proxy():
    """Make proxies in front of a local port; every one is closed (its connections cut) afterwards."""
    made: list[TcpProxy] = []

    def make(port: int, host: str = "127.0.0.1") -> TcpProxy:
        made.append(TcpProxy(port, host))
        return made[-1]

    yield make
    for proxy in made:
        proxy.close()


@pytest.fixture(scope="module", autouse=True)
def counts_table():
    yield
    if RESULTS:
        print("\n\n" + markdown_table(RESULTS))


def report(counts: FaultCounts) -> None:
    RESULTS.append(counts)
    print("\n" + counts.summary())


def test_the_proxy_cuts_both_ways_and_refuses_for_a_while(tcp_proxy, pg_schema):
    url = make_url(PG_URL)
    proxy = tcp_proxy(url.port or 5432, url.host or "127.0.0.1")
    dsn = url.set(drivername="postgresql", host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    conn = psycopg.connect(dsn, autocommit=True)
    assert conn.execute("select 1").fetchone() == (1,)
    assert proxy.open_connections() == 1
    assert proxy.cut() == 1
    with pytest.raises(psycopg.OperationalError):
        conn.execute("select 1")
    conn.close()
    proxy.refuse_for(1.0)
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(dsn, connect_timeout=5)
    time.sleep(1.1)
    with psycopg.connect(dsn, connect_timeout=5) as again:
        assert again.execute("select 2").fetchone() == (2,)
    assert proxy.refused >= 1 and proxy.cut_connections == 1


def assert_faults_were_injected(counts: FaultCounts) -> None:
    assert counts.errors == [], (
        "a pump or the consumer failed on a fault it should survive:\n" + "\n".join(counts.errors))
    assert counts.kills >= 3 and counts.cuts >= 4 and counts.terminations >= 2, counts.summary()
    assert counts.notes["connections_cut"] > 0, counts.summary()
    assert counts.notes["backends_terminated"] > 0, counts.summary()


def test_pumps_to_rabbitmq_through_kills_cuts_and_terminations_lose_nothing_and_are_never_early(
        pg_schema, rabbit_vhost):
    counts = pump_faults("rabbitmq", pg_schema, rabbit_vhost, pg_url=PG_URL)
    report(counts)
    assert_faults_were_injected(counts)
    assert counts.lost == 0 and counts.unexpected == 0, counts.summary()
    assert counts.early == 0, counts.summary()
    assert counts.duplicates <= counts.duplicate_bound, counts.summary()  # at least once: the batches in flight
    assert counts.left_in_store == 0 and counts.dead_lettered == 0, counts.summary()


def test_pumps_to_a_sql_table_in_the_same_database_through_the_same_faults_are_exactly_once(pg_schema):
    counts = pump_faults("sql", pg_schema, pg_url=PG_URL)
    report(counts)
    assert_faults_were_injected(counts)
    assert counts.notes["exactly_once"] == [True], counts.summary()  # the pumps inserted in their claims
    assert counts.lost == 0 and counts.unexpected == 0, counts.summary()
    assert counts.early == 0, counts.summary()
    assert counts.duplicates == 0, counts.summary()  # dispatch joins the claim's transaction
    assert counts.left_in_store == 0 and counts.dead_lettered == 0, counts.summary()


def test_sqs_relay_killed_mid_cycle_loses_nothing_and_is_never_early(moto_server):
    counts = sqs_relay_faults(moto_server)
    report(counts)
    assert counts.errors == [], "\n".join(counts.errors)
    assert counts.kills >= 3 and counts.notes["killed_between_send_and_delete"] >= 1, counts.summary()
    assert counts.lost == 0 and counts.unexpected == 0, counts.summary()
    assert counts.early == 0, counts.summary()
    assert counts.duplicates <= counts.duplicate_bound, counts.summary()  # one receive in the relay's hands per kill

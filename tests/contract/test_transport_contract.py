"""One contract for every transport: the in-memory fake, SQL tables (SQLite, PostgreSQL), RabbitMQ, SQS (standard
and FIFO queues)."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import pytest

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import DestinationNotFoundError, InvalidInputError
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.testing import InMemoryTransport

SERVICES = pytest.mark.services


@pytest.fixture(params=["memory", "sql-sqlite", pytest.param("sql-postgres", marks=SERVICES),
                        pytest.param("rabbitmq", marks=SERVICES), pytest.param("sqs", marks=SERVICES),
                        pytest.param("sqs-fifo", marks=SERVICES), "directory"])
def transport(request, tmp_path):
    kind = request.param
    if kind == "memory":
        made = InMemoryTransport()
    elif kind == "directory":  # the toy transport of tests/toy, added by one module and one registry entry
        from tests.toy.directory_transport import DirectoryTransport

        made = DirectoryTransport(tmp_path / "queues")
    elif kind.startswith("sql"):
        from airflow_delay_provider.transports.sql import SqlTableTransport

        if kind == "sql-sqlite":
            made = SqlTableTransport(f"sqlite:///{tmp_path / 'queues.db'}", table_prefix="c_")
        else:
            from tests.conftest import PG_URL

            made = SqlTableTransport(PG_URL, schema=request.getfixturevalue("pg_schema"),
                                     table_prefix=f"c{uuid.uuid4().hex[:8]}_")
    elif kind == "rabbitmq":
        made = request.getfixturevalue("rabbit")
    else:
        from airflow_delay_provider.transports.sqs import SqsTransport

        # sqs-fifo: the same contract on FIFO destinations (`q` names them `<name>.fifo`).
        made = SqsTransport(request.getfixturevalue("sqs_client"), queue_delay=1, prefix=f"c{uuid.uuid4().hex[:6]}-")
    yield made
    made.close()


@pytest.fixture
def q(request):
    """The contract's queue names on the transport under test: SQS FIFO queues end in `.fifo`."""
    fifo = request.node.callspec.params.get("transport") == "sqs-fifo"
    return lambda name: f"{name}.fifo" if fifo else name


def msg(n: int, destination: str = "orders") -> DelayedMessage:
    return DelayedMessage(destination, f"body-{n}".encode(), utcnow() - timedelta(seconds=1), {"n": str(n)}, f"m-{n}")


def receive_all(transport, endpoint: str, expected: int, timeout: float = 10.0) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < expected and time.monotonic() < deadline:
        batch = transport.receive(endpoint, max_messages=10, visibility_timeout=30)
        got.extend(batch)
        if not batch:
            time.sleep(0.05)
    return got


def test_provisioning_is_idempotent_and_names_are_checked_first(transport, q):
    transport.provision(q("orders"))
    transport.provision(q("orders"))
    assert transport.verify([q("orders")])["complete"]
    with pytest.raises(InvalidInputError):
        transport.check_endpoint("")


def test_a_sent_message_is_received_intact_and_gone_once_acked(transport, q):
    transport.provision(q("orders"))
    assert transport.send([msg(1, q("orders")), msg(2, q("orders"))]) == {}
    got = receive_all(transport, q("orders"), 2)
    assert sorted(m.message_id for m in got) == ["m-1", "m-2"]
    for m in got:
        assert m.body == f"body-{m.message_id[2:]}".encode() and m.headers["n"] == m.message_id[2:]
        assert m.destination == q("orders")
    assert transport.ack(q("orders"), [m.receipt for m in got]) == 2
    time.sleep(0.2)
    assert transport.depth(q("orders"))["visible"] == 0
    assert transport.receive(q("orders"), max_messages=10) == []


def test_one_unknown_destination_does_not_stop_the_rest_of_a_batch(transport, q):
    transport.provision(q("orders"))
    failures = transport.send([msg(1, q("orders")), msg(2, q("nowhere")), msg(3, q("orders"))])
    # Where the broker tells (every transport but RabbitMQ, which keeps it in `unroutable`), it says why.
    assert set(failures) <= {"m-2"}
    assert all(isinstance(e, DestinationNotFoundError) for e in failures.values())
    got = receive_all(transport, q("orders"), 2)
    assert sorted(m.message_id for m in got) == ["m-1", "m-3"]


def test_the_depth_of_a_queue_counts_what_is_waiting(transport, q):
    transport.provision(q("orders"))
    transport.send([msg(n, q("orders")) for n in range(3)])
    deadline = time.monotonic() + 10
    while transport.depth(q("orders"))["visible"] < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert transport.depth(q("orders"))["visible"] == 3


def take_held(transport, expected: int, timeout: float = 10.0) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < expected and time.monotonic() < deadline:
        batch = transport.take_held(10)
        got.extend(batch)
        if not batch:
            time.sleep(0.05)
    return got


def test_a_message_held_until_due_is_taken_back_intact_and_settled(transport):
    if not transport.can_take_back:
        pytest.skip(f"{transport.name} does not hold messages until due")
    transport.provision("orders")
    later = utcnow() + timedelta(hours=1)
    sent = {f"h-{n}": DelayedMessage("orders", f"body-{n}".encode(), later + timedelta(seconds=n), {"n": str(n)},
                                     f"h-{n}") for n in range(3)}
    assert transport.send(list(sent.values())) == {}
    held = take_held(transport, 3)
    assert {h.message.message_id: h.message for h in held} == sent  # id, destination, body, headers, due time
    assert transport.take_held(10) == []  # taken ones are hidden until settled
    first, *rest = held
    transport.release_held([first.receipt])
    [again] = take_held(transport, 1)
    assert again.message == first.message
    assert transport.ack_held([again.receipt, *(h.receipt for h in rest)]) == 3
    time.sleep(0.2)
    assert transport.take_held(10) == [] and transport.receive("orders", max_messages=10) == []


class _Ids:
    """The ids a native send records (the store's ids table), in a set."""

    def __init__(self) -> None:
        self.sent: set[str] = set()

    def unseen(self, message_ids):
        return [m for m in message_ids if m not in self.sent]

    def remember_sent(self, message_ids) -> None:
        self.sent.update(message_ids)


@pytest.mark.parametrize("mode", ["replace", "keep_earliest", "replace_body"])
def test_native_delays_refuse_every_on_duplicate_mode_but_skip_and_send_nothing(transport, q, mode):
    """A broker's own delays (RabbitMQ, SQS, the in-memory transport) cannot change or withdraw a message once sent:
    a mode other than `skip` is refused naming the mode and the transport, before anything is sent. A transport
    without native delays is only a destination of the store's dispatch, where every mode applies."""
    from airflow_delay_provider.core.breakers import CircuitBreaker
    from airflow_delay_provider.core.sending import send_natively

    endpoint = q("dups")
    transport.provision(endpoint)
    ids = _Ids()
    if transport.delays_natively:
        with pytest.raises(InvalidInputError, match=f"on_duplicate='{mode}'.*'{transport.name}'.*skip"):
            send_natively(ids, transport, [msg(1, endpoint)], CircuitBreaker("test", 5), on_duplicate=mode)
        assert ids.sent == set() and sum(transport.depth(endpoint).values()) == 0
    assert send_natively(ids, transport, [msg(1, endpoint)], CircuitBreaker("test", 5), on_duplicate="skip") == 1
    assert [m.message_id for m in receive_all(transport, endpoint, 1)] == ["m-1"]

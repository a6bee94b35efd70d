"""One contract for every delayed-message store: the in-memory fake, SQLite and PostgreSQL.

Claims, de-duplication and waiting; then operating the backlog: browse, counts, cancel, reschedule, run
now, pause/resume and purge. What only the SQL store has (bulk-sweep leases, pumps racing actions on
PostgreSQL) is in tests/integration/test_backlog.py."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import pytest

from airflow_delay_provider.core.backlog import Selector, new_due_time
from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import InvalidInputError, UnknownDestinationError
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.testing import InMemoryStore
from tests.helpers import orders, spread_backlog


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.services)])
def store(request, tmp_path):
    if request.param == "memory":
        yield InMemoryStore()
        return
    from tests.helpers import make_store

    if request.param == "sqlite":
        url, schema = f"sqlite:///{tmp_path / 'contract.db'}", None
    else:
        from tests.conftest import PG_URL

        url, schema = PG_URL, request.getfixturevalue("pg_schema")
    store = make_store(url, schema, f"c_{uuid.uuid4().hex[:12]}")
    yield store
    store.close()


def msg(n: int, seconds: float = 0.0, destination: str = "orders") -> DelayedMessage:
    return DelayedMessage(destination, f"body-{n}".encode(), utcnow() + timedelta(seconds=seconds), {"n": str(n)},
                          f"m-{n}")


def test_only_due_messages_are_claimed_oldest_first_and_settled_ones_leave(store):
    assert store.store([msg(1, -2), msg(2, -5), msg(3, 60)]) == 3
    with store.claim_due(store.clock(), limit=10) as claim:
        assert [m.message_id for m in claim.messages] == ["m-2", "m-1"]
        assert claim.remove(["m-2"]) == 1
    # m-1 was neither removed nor retried: it is back, due as before.
    assert store.count_scheduled() == {"orders": 2}
    assert store.next_due() < utcnow()


def test_a_claim_hands_a_message_out_once_and_an_error_releases_the_batch(store):
    store.store([msg(n, -1) for n in range(5)])
    with store.claim_due(store.clock(), limit=3) as first:
        if store.concurrent_claims:
            with store.claim_due(store.clock(), limit=10) as second:
                assert {m.message_id for m in second.messages}.isdisjoint(m.message_id for m in first.messages)
                second.remove([m.message_id for m in second.messages])
        first_ids = [m.message_id for m in first.messages]
    with pytest.raises(RuntimeError), store.claim_due(store.clock(), limit=10) as claim:
        assert claim.messages
        raise RuntimeError("the transport failed mid-batch")
    left = store.count_scheduled().get("orders", 0)
    assert left == (3 if store.concurrent_claims else 5) and len(first_ids) == 3


def test_a_retry_counts_the_failure_and_reschedules(store):
    store.store([msg(1, -1)])
    later = utcnow() + timedelta(seconds=30)
    with store.claim_due(store.clock(), limit=10) as claim:
        claim.retry({"m-1": later}, {"m-1": {"n": "1", "why": "broker down"}})
    with store.claim_due(store.clock(), limit=10) as claim:
        assert claim.messages == []
    assert store.next_due() == later
    with store.claim_due(later + timedelta(seconds=1), limit=10) as claim:
        [m] = claim.messages
        assert m.failures == 1 and m.headers["why"] == "broker down" and m.body == b"body-1"
        claim.remove(["m-1"])
    assert store.count_scheduled() == {}


def test_ids_are_stored_once_and_a_window_and_exclusions_bound_the_claim(store):
    assert store.store([msg(1, -1), msg(1, -1), msg(2, -1, "refunds")]) == 2
    assert store.store([msg(1, -1)]) == 0
    with store.claim_due(store.clock(), limit=10, exclude=["refunds"]) as claim:
        assert [m.message_id for m in claim.messages] == ["m-1"]
    cutoff = utcnow() - timedelta(seconds=10)
    with store.claim_due(store.clock(), limit=10, due_before=cutoff) as claim:
        assert claim.messages == []
    assert store.count_scheduled() == {"orders": 1, "refunds": 1}
    assert store.next_due("refunds") is not None and store.next_due("nowhere") is None


def test_a_sooner_message_wakes_a_waiting_store(store):
    woke = threading.Event()

    def wait():
        store.wait(utcnow() + timedelta(seconds=20))
        woke.set()

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    store.store([msg(1, -1)])
    # Woken by the store (PostgreSQL's NOTIFY, the fake's condition) or by its short poll (SQLite).
    assert woke.wait(5.0)


# -- operating the backlog ------------------------------------------------------------------------------
def _ids(messages):
    return [m["message_id"] for m in messages]


def test_browse_pages_in_due_order_with_filters_and_claims_nothing(store):
    stored_at = orders(store, 7, body=b"a" * 500)
    orders(store, 3, destination="refunds", due_in=-5)
    everything = Selector.build(allow_everything=True)
    first = store.browse(everything, limit=4)
    second = store.browse(everything, limit=4, after=first["next"])
    third = store.browse(everything, limit=4, after=second["next"])
    assert _ids(first["messages"]) == ["refunds-0", "refunds-1", "refunds-2", "orders-0"]
    assert _ids(second["messages"]) == [f"orders-{i}" for i in range(1, 5)]
    assert _ids(third["messages"]) == ["orders-5", "orders-6"] and third["next"] is None
    shown = first["messages"][3]
    assert shown["body_bytes"] == 500 and shown["body_truncated"] and len(shown["body"]) == 200
    assert shown["headers"] == {"order-id": "0"} and not shown["in_flight"] and not shown["paused"]
    assert "body" not in store.browse(everything, body_bytes=None)["messages"][0]

    by_header = store.browse(Selector.build(headers={"order-id": "1"}))
    assert _ids(by_header["messages"]) == ["refunds-1", "orders-1"]
    assert _ids(store.browse(Selector.build(destination="refunds", headers={"order-id": "2"}))["messages"]) == [
        "refunds-2"]
    # Around the due times of orders-2..4 (3600 s + i after they were stored), however long the test took so far.
    window = Selector.build(destination="orders", due_from=stored_at + timedelta(seconds=3601.5),
                            due_before=stored_at + timedelta(seconds=3604.5))
    assert _ids(store.browse(window)["messages"]) == ["orders-2", "orders-3", "orders-4"]
    # Reading claimed nothing: the due messages are all still there for a pump.
    with store.claim_due(utcnow(), 100) as claim:
        assert sorted(m.message_id for m in claim.messages) == ["refunds-0", "refunds-1", "refunds-2"]
    with pytest.raises(InvalidInputError, match="cursor"):
        store.browse(everything, after="nonsense")


def test_backlog_counts_buckets_and_pauses(store):
    spread_backlog(store)
    report = store.backlog()
    ordered, refunds = report["destinations"]["orders"], report["destinations"]["refunds"]
    assert ordered["histogram"] == {"due": 2, "next_minute": 1, "next_hour": 1, "next_day": 1, "later": 2}
    assert ordered["scheduled"] == 7 and ordered["due"] == 2 and not ordered["paused"]
    assert refunds["paused"] and refunds["due"] == 2
    assert report["totals"] == {"scheduled": 9, "due": 4, "in_flight": 0, "held": 0, "paused_due": 2}
    # One set of words for the histogram, carried by the report the CLI prints and the page draws.
    assert [b["key"] for b in report["buckets"]] == list(ordered["histogram"])
    assert [b["label"] for b in report["buckets"]] == ["Due now", "< 1 minute", "< 1 hour", "< 1 day", "Later"]


def test_cancel_by_ids_reports_each_and_is_idempotent(store):
    orders(store, 5)
    result = store.cancel(Selector.build(message_ids=["orders-1", "orders-3", "never-sent"]))
    assert sorted(result["cancelled"]) == ["orders-1", "orders-3"]
    assert result["unknown"] == ["never-sent"] and result["gone"] == []
    again = store.cancel(Selector.build(message_ids=["orders-1"]))
    assert again["cancelled"] == [] and again["gone"] == ["orders-1"]
    assert sorted(m.message_id for m in [store.get(f"orders-{i}") for i in range(5)] if m) == [
        "orders-0", "orders-2", "orders-4"]
    # A cancelled id stays accepted: sending it again stores nothing (a retried send task cannot revive it).
    orders(store, 2)
    assert store.get("orders-1") is None


def test_cancel_by_header_and_destination(store):
    orders(store, 4)
    orders(store, 4, destination="refunds")
    by_header = store.cancel(Selector.build(headers={"order-id": "2"}))
    assert sorted(by_header["cancelled"]) == ["orders-2", "refunds-2"] and by_header["counts"]["cancelled"] == 2
    whole = store.cancel(Selector.build(destination="refunds"))
    assert whole["counts"]["cancelled"] == 3 and store.count_scheduled() == {"orders": 3}


@pytest.mark.parametrize("selector", [{}, {"message_ids": []}, {"destination": ""}, {"headers": {}}])
def test_an_empty_selector_is_refused(store, selector):
    orders(store, 2)
    with pytest.raises(InvalidInputError, match="would apply to every message"):
        store.cancel(Selector.build(**selector))
    assert sum(store.count_scheduled().values()) == 2


def test_unknown_destinations_are_refused_by_name(store):
    orders(store, 1)
    with pytest.raises(UnknownDestinationError, match=r"unknown destination\(s\) \['ordres'\].*'orders'"):
        store.cancel(Selector.build(destination="ordres"))
    with pytest.raises(UnknownDestinationError):
        store.set_paused(["ordres"], True)
    with pytest.raises(UnknownDestinationError):
        store.purge("ordres", dry_run=False)
    store.register_destinations(["provisioned-only"])
    assert store.set_paused(["provisioned-only"], True) == {"changed": ["provisioned-only"], "unchanged": []}


def test_reschedule_later_and_run_now(store):
    orders(store, 3)
    later = new_due_time(store.clock(), delay_seconds=7200)
    moved = store.reschedule(Selector.build(message_ids=["orders-0"]), later)
    assert moved["rescheduled"] == ["orders-0"] and store.get("orders-0").due_at == later
    now = store.reschedule(Selector.build(message_ids=["orders-1", "orders-9"]),
                           new_due_time(store.clock(), delay_seconds=0))
    assert now["rescheduled"] == ["orders-1"] and now["unknown"] == ["orders-9"]
    with store.claim_due(utcnow(), 10) as claim:
        assert [m.message_id for m in claim.messages] == ["orders-1"]
    with pytest.raises(InvalidInputError, match="in the past"):
        new_due_time(utcnow(), deliver_at=utcnow() - timedelta(minutes=5))
    with pytest.raises(InvalidInputError, match="exactly one"):
        new_due_time(utcnow())


def test_pause_keeps_due_messages_stored_and_resume_releases_them(store):
    orders(store, 3, due_in=-2)
    orders(store, 2, destination="refunds", due_in=-2)
    assert store.set_paused(["orders"], True)["changed"] == ["orders"]
    assert store.set_paused(["orders"], True) == {"changed": [], "unchanged": ["orders"]}
    assert store.next_due("orders") is None
    with store.claim_due(utcnow(), 10) as claim:
        assert sorted(m.message_id for m in claim.messages) == ["refunds-0", "refunds-1"]
        claim.remove([m.message_id for m in claim.messages])
    assert store.count_scheduled() == {"orders": 3}
    store.set_paused(["orders"], False)
    with store.claim_due(utcnow(), 10) as claim:
        assert [m.message_id for m in claim.messages] == ["orders-0", "orders-1", "orders-2"]


def test_purge_counts_first_then_removes_one_destination(store):
    orders(store, 5)
    orders(store, 2, destination="refunds")
    assert store.purge("orders") == {"destination": "orders", "dry_run": True, "would_purge": 5, "in_flight": 0}
    assert store.count_scheduled() == {"orders": 5, "refunds": 2}
    assert store.purge("orders", dry_run=False)["purged"] == 5
    assert store.count_scheduled() == {"refunds": 2}


def test_a_repeated_reschedule_reports_the_message_rescheduled_and_an_empty_selector_changes_nothing(store):
    from airflow_delay_provider.core.backlog import Selector
    from airflow_delay_provider.core.errors import InvalidInputError

    store.store([msg(1, 600), msg(2, 600)])
    at = store.clock() + timedelta(hours=1)
    assert store.reschedule(Selector.build(message_ids=["m-1"]), at)["rescheduled"] == ["m-1"]
    again = store.reschedule(Selector.build(message_ids=["m-1"]), at)
    assert again["rescheduled"] == ["m-1"] and again["gone"] == []
    for action in (lambda: store.cancel(Selector()), lambda: store.reschedule(Selector(), at)):
        with pytest.raises(InvalidInputError, match="would apply to every message"):
            action()
    assert store.count_scheduled() == {"orders": 2}


def test_a_destination_is_forgotten_only_once_empty_unless_forced(store):
    spread_backlog(store)  # orders (7 scheduled), refunds (2, paused)
    store.register_destinations(["ordres"])  # a typo, provisioned once
    store.set_policies({"ordres": {"healthyRetryPolicy": {"numRetries": 1}}})
    with pytest.raises(InvalidInputError, match=r"cannot forget \['refunds'\]: they still have scheduled messages"):
        store.forget_destinations(["refunds", "ordres"])
    assert "ordres" in store.destinations()  # refused as a whole: nothing was forgotten
    assert store.forget_destinations(["ordres"]) == {"forgotten": ["ordres"], "purged": {"ordres": 0}}
    assert "ordres" not in store.destinations() and "ordres" not in store.backlog()["destinations"]
    assert "ordres" not in store.policies()
    with pytest.raises(UnknownDestinationError):
        store.forget_destinations(["ordres"])  # already forgotten: unknown now
    with pytest.raises(InvalidInputError, match="name the destination"):
        store.forget_destinations([])

    assert store.forget_destinations(["refunds"], force=True) == {"forgotten": ["refunds"], "purged": {"refunds": 2}}
    assert "refunds" not in store.backlog()["destinations"] and store.count_scheduled() == {"orders": 7}
    # Sent to again: known again, and not paused any more.
    assert store.store([DelayedMessage("refunds", b"", utcnow() + timedelta(hours=1), message_id="refunds-new")]) == 1
    assert store.destinations()["refunds"]["paused"] is False


# -- on_duplicate: what a send of a stored id does (core/duplicates.py) -----------------------------------------------
def _stored(store, message_id: str):
    page = store.browse(Selector(message_ids=(message_id,)), body_bytes=100)["messages"]
    return None if not page else (page[0]["destination"], page[0]["due_at"], page[0]["body"], page[0]["headers"])


@pytest.mark.parametrize(("mode", "second_delay", "expected"), [
    ("skip", 30, ("orders", 600, "body-1", "1")),
    ("replace", 30, ("refunds", 30, "body-2", "2")),  # a debounce: the last send's time, body and destination
    ("replace", 900, ("refunds", 900, "body-2", "2")),
    ("keep_earliest", 30, ("refunds", 30, "body-2", "2")),  # the earlier one wins, with its body
    ("keep_earliest", 900, ("orders", 600, "body-1", "1")),
    ("replace_body", 30, ("orders", 600, "body-2", "2")),  # the body and headers; the due time and destination stay
])
def test_a_duplicate_of_a_stored_message_does_what_its_mode_says(store, mode, second_delay, expected):
    now = store.clock()
    first = DelayedMessage("orders", b"body-1", now + timedelta(seconds=600), {"n": "1"}, "m-1")
    second = DelayedMessage("refunds", b"body-2", now + timedelta(seconds=second_delay), {"n": "2"}, "m-1")
    assert store.store([first]) == 1
    changed = store.store([second], on_duplicate=mode)
    destination, delay, body, n = expected
    assert changed == int(expected != ("orders", 600, "body-1", "1"))
    want_due = (now + timedelta(seconds=delay)).isoformat()
    assert _stored(store, "m-1") == (destination, want_due, body, {"n": n})
    assert sum(store.count_scheduled().values()) == 1
    with store.claim_due(now + timedelta(seconds=delay - 1), limit=10) as claim:
        assert claim.messages == []  # never before the due time it has now
    with store.claim_due(now + timedelta(seconds=delay), limit=10) as claim:
        assert [(m.message_id, m.body) for m in claim.messages] == [("m-1", body.encode())]
        claim.remove(["m-1"])


@pytest.mark.parametrize("mode", ["replace", "keep_earliest", "replace_body"])
def test_a_duplicate_of_a_delivered_message_within_the_window_is_skipped_in_every_mode(store, mode):
    store.store([msg(1, -1)])
    with store.claim_due(store.clock(), limit=10) as claim:
        claim.remove(["m-1"])
    assert store.store([msg(1, -60)], on_duplicate=mode) == 0
    assert store.count_scheduled() == {}


def test_an_id_twice_in_one_send_is_two_sends_in_a_row(store):
    now = store.clock()
    batch = [DelayedMessage("orders", f"b{n}".encode(), now + timedelta(seconds=s), message_id=i)
             for n, (i, s) in enumerate([("a", 60), ("a", 30), ("a", 90), ("b", 60), ("b", 30)])]
    assert store.store(batch, on_duplicate="keep_earliest") == 2
    assert [_stored(store, i)[1:3] for i in "ab"] == [((now + timedelta(seconds=30)).isoformat(), "b1"),
                                                      ((now + timedelta(seconds=30)).isoformat(), "b4")]
    assert store.store(batch, on_duplicate="replace") == 2  # each id's last: "a" at 90 s, "b" at 30 s
    assert [_stored(store, i)[1:3] for i in "ab"] == [((now + timedelta(seconds=90)).isoformat(), "b2"),
                                                      ((now + timedelta(seconds=30)).isoformat(), "b4")]


def test_an_unknown_mode_is_refused_naming_the_allowed_ones_and_nothing_is_stored(store):
    with pytest.raises(InvalidInputError, match="skip, replace, keep_earliest, replace_body.*'debounce'"):
        store.store([msg(1, 60)], on_duplicate="debounce")
    assert store.count_scheduled() == {}


@pytest.mark.parametrize("outcome", ["delivered", "retried"])
def test_a_duplicate_of_a_claimed_message_waits_for_the_claims_outcome(store, outcome):
    """Delivered: the send is skipped (never delivered twice within the window). Written back for a retry: the
    send changes it."""
    store.store([msg(1, -1)])
    later = store.clock() + timedelta(seconds=300)
    result: dict[str, int] = {}
    sending = threading.Thread(target=lambda: result.update(
        n=store.store([DelayedMessage("orders", b"new", later, message_id="m-1")], on_duplicate="replace")))
    with store.claim_due(store.clock(), limit=10) as claim:
        assert [m.message_id for m in claim.messages] == ["m-1"]
        sending.start()
        sending.join(0.5)
        assert sending.is_alive(), "the send did not wait for the claim"
        if outcome == "delivered":
            claim.remove(["m-1"])
        else:
            claim.retry({"m-1": store.clock() + timedelta(seconds=30)})
    sending.join(30)
    if outcome == "delivered":
        assert result == {"n": 0} and store.count_scheduled() == {}
    else:
        assert result == {"n": 1} and _stored(store, "m-1")[1:3] == (later.isoformat(), "new")


# -- editing one scheduled message ------------------------------------------------------------------------------------
def test_an_edit_changes_the_body_and_headers_and_keeps_the_due_time(store):
    due = store.clock() + timedelta(seconds=600)
    store.store([DelayedMessage("orders", b"old", due, {"a": "1", "b": "2"}, "m-1")])
    report = store.edit("m-1", body="new \u00e9", headers={"c": "3"})
    assert report["edited"] == ["m-1"] and report["counts"]["edited"] == 1
    assert _stored(store, "m-1") == ("orders", due.isoformat(), "new \u00e9", {"c": "3"})
    assert store.edit("m-1", headers={})["edited"] == ["m-1"]  # headers alone; the body stays
    assert _stored(store, "m-1") == ("orders", due.isoformat(), "new \u00e9", {})
    with store.claim_due(due, limit=10) as claim:
        assert [(m.body, m.headers, m.due_at) for m in claim.messages] == [("new \u00e9".encode(), {}, due)]
        claim.remove(["m-1"])
    gone = store.edit("m-1", body="late")
    assert gone["edited"] == [] and gone["gone"] == ["m-1"]
    assert store.edit("never-sent", body="x")["unknown"] == ["never-sent"]


def test_an_edit_of_a_message_a_claim_holds_is_refused_and_the_delivery_keeps_its_body(store):
    """Refused while the claim holds it (in flight); on SQLite, whose claim holds the database's write lock, the edit
    waits for the claim instead and finds the message delivered (gone)."""
    store.store([msg(1, -1)])
    result: dict = {}
    editing = threading.Thread(target=lambda: result.update(store.edit("m-1", body="too late")))
    with store.claim_due(store.clock(), limit=10) as claim:
        assert [m.body for m in claim.messages] == [b"body-1"]
        editing.start()
        editing.join(0.5 if not store.concurrent_claims else 30)
        assert editing.is_alive() != store.concurrent_claims
        claim.remove(["m-1"])
    editing.join(30)
    assert result["edited"] == [] and result["in_flight" if store.concurrent_claims else "gone"] == ["m-1"]
    assert store.count_scheduled() == {}


@pytest.mark.parametrize(("kwargs", "pattern"), [
    ({}, r"an edit needs a new body and/or new headers"),
    ({"body": {"a": 1}}, r"body must be bytes or str, got dict"),
    ({"headers": {"n": 5}}, r"header 'n' must have a str value"),
])
def test_a_bad_edit_is_refused_and_changes_nothing(store, kwargs, pattern):
    store.store([msg(1, 60)])
    with pytest.raises(InvalidInputError, match=pattern):
        store.edit("m-1", **kwargs)
    assert _stored(store, "m-1")[2:] == ("body-1", {"n": "1"})


def _filtered(store, n: int = 40) -> list[DelayedMessage]:
    """`n` messages of two destinations, due a minute apart, every third body holding a customer's name (one in
    UTF-8 beyond ASCII, one with LIKE's wildcards), every fourth with a `tier: gold` header."""
    now = store.clock()
    names = ["Zoë", "50%_off", "plain"]
    sent = [DelayedMessage("orders" if i % 2 else "refunds", f"order {i} for {names[i % 3]}".encode(),
                           now + timedelta(minutes=10 + i), {"tier": "gold"} if i % 4 == 0 else {}, f"f-{i}")
            for i in range(n)]
    store.store(sent)
    return sent


def _small_batches(store, size: int = 3) -> None:
    """A SQL store changes a filter's messages `size` per transaction: many batches from a few messages."""
    if hasattr(store, "controls"):
        store.controls.batch = size


@pytest.mark.parametrize("selection", [
    {"body_contains": "Zoë"},
    {"body_contains": "50%_"},
    {"body_contains": "%"},  # a wildcard to LIKE, a character here: only the one body that has it
    {"destination": "orders", "body_contains": "plain"},
    {"headers": {"tier": "gold"}, "due_before": "+20m"},
    {"due_from": "+15m", "due_before": "+30m"},
])
def test_a_filter_is_counted_first_then_cancelled_in_batches_exactly(store, selection):
    sent = _filtered(store)
    now = store.clock()
    selection = {k: (now + timedelta(minutes=int(v[1:-1])) if isinstance(v, str) and v.startswith("+") else v)
                 for k, v in selection.items()}
    selector = Selector.build(**selection)
    expected = sorted(m.message_id for m in sent if selector.matches(m))
    assert expected and len(expected) < len(sent)
    counted = store.count_selected(selector)
    assert (counted["dry_run"], counted["would_cancel"], counted["in_flight"]) == (True, len(expected), 0)
    assert sum(store.count_scheduled().values()) == len(sent)  # counting changed nothing
    _small_batches(store)
    report = store.cancel(selector)
    assert sorted(report["cancelled"]) == expected and report["counts"] == {"cancelled": len(expected),
                                                                            "in_flight": 0}
    if hasattr(store, "controls"):
        assert report["batches"] == -(-len(expected) // 3)
    left = sorted(m["message_id"] for m in store.browse(Selector(), limit=100)["messages"])
    assert left == sorted(m.message_id for m in sent if m.message_id not in expected)
    assert store.count_selected(selector)["would_cancel"] == 0
    # The cancelled ids stay accepted, as after a cancel by ids: a retried send cannot revive them.
    assert store.store([m for m in sent if m.message_id in expected]) == 0


def test_a_reschedule_by_a_filter_moves_each_once_and_counts_those_already_there(store):
    sent = _filtered(store, 25)
    _small_batches(store, 2)
    at = store.clock() + timedelta(hours=3)
    first = store.reschedule(Selector.build(destination="orders", due_before=store.clock() + timedelta(minutes=30)),
                             at)
    moved = sorted(m.message_id for m in sent if m.destination == "orders" and m.due_at < at - timedelta(
        hours=3) + timedelta(minutes=30))
    assert sorted(first["rescheduled"]) == moved and first["counts"]["rescheduled"] == len(moved)
    assert all(store.get(i).due_at == at for i in moved)
    # Again, by a filter the moved ones still match with others: each is counted once, the moved ones as they are.
    again = store.reschedule(Selector.build(destination="orders"), at)
    orders_all = sorted(m.message_id for m in sent if m.destination == "orders")
    assert sorted(again["rescheduled"]) == orders_all and again["counts"]["rescheduled"] == len(orders_all)
    assert {store.get(i).due_at for i in orders_all} == {at}
    refunds = [m for m in sent if m.destination == "refunds"]
    assert all(store.get(m.message_id).due_at == m.due_at for m in refunds)


def test_run_now_by_a_body_search_makes_only_those_due(store):
    sent = _filtered(store, 12)
    _small_batches(store, 1)
    report = store.reschedule(Selector.build(body_contains="Zoë"), store.clock())
    chosen = sorted(m.message_id for m in sent if "Zoë" in m.body.decode())
    assert sorted(report["rescheduled"]) == chosen
    with store.claim_due(utcnow() + timedelta(seconds=1), 100) as claim:
        assert sorted(m.message_id for m in claim.messages) == chosen


@pytest.mark.parametrize(("selection", "pattern"), [
    ({"body_contains": "x" * 201}, "at most 200 characters"),
    ({"body_contains": 42}, "body_contains must be text"),
    ({"due_from": "+20m", "due_before": "+10m"}, "must be before"),
])
def test_a_bad_filter_is_refused_and_changes_nothing(store, selection, pattern):
    sent = _filtered(store, 6)
    now = store.clock()
    selection = {k: (now + timedelta(minutes=int(v[1:-1])) if isinstance(v, str) and v.startswith("+") else v)
                 for k, v in selection.items()}
    with pytest.raises(InvalidInputError, match=pattern):
        store.cancel(Selector.build(**selection))
    assert sum(store.count_scheduled().values()) == len(sent)


def _tenants(store, n: int = 12) -> list[DelayedMessage]:
    """`n` messages due a second apart in the past, tenants a and b in turn, and one of tenant a due in an hour."""
    now = store.clock()
    sent = [DelayedMessage("orders", f"order {i}".encode(), now - timedelta(seconds=n - i),
                           {"tenant": "ab"[i % 2]}, f"t-{i}") for i in range(n)]
    sent.append(DelayedMessage("orders", b"later", now + timedelta(hours=1), {"tenant": "a"}, "t-later"))
    store.store(sent)
    return sent


def test_a_paused_filter_is_counted_first_never_claimed_and_resumed_to_its_due_times(store):
    sent = _tenants(store)
    tenant_a = sorted(m.message_id for m in sent if m.headers["tenant"] == "a")
    selector = Selector.build(headers={"tenant": "a"})
    counted = store.count_selected(selector, "pause")
    assert (counted["would_pause"], counted["in_flight"]) == (len(tenant_a), 0)
    _small_batches(store, 2)
    report = store.pause_messages(selector)
    assert sorted(report["paused"]) == tenant_a
    assert report["counts"] == {"paused": len(tenant_a), "in_flight": 0, "already_paused": 0}
    if hasattr(store, "controls"):
        assert report["batches"] == -(-len(tenant_a) // 2)
    # Paused ones are never claimed, whatever their due time, and the next due time passes over them.
    with store.claim_due(store.clock(), limit=100) as claim:
        assert sorted(m.message_id for m in claim.messages) == sorted(m.message_id for m in sent
                                                                     if m.headers["tenant"] == "b")
        claim.remove([m.message_id for m in claim.messages])
    assert store.next_due() is None
    # They are still there for every reader: browse marks them, the backlog counts them, a story says so.
    page = store.browse(Selector(), limit=100)["messages"]
    assert sorted(m["message_id"] for m in page if m["held"]) == tenant_a and all(m["held"] for m in page)
    entry = store.backlog("orders")["destinations"]["orders"]
    assert (entry["scheduled"], entry["held"]) == (len(tenant_a), len(tenant_a))
    assert store.message_story("t-0")["state"] == "held"
    again = store.pause_messages(selector)
    assert again["paused"] == [] and again["counts"]["already_paused"] == len(tenant_a)
    assert store.count_selected(selector, "pause")["would_pause"] == 0
    assert store.count_selected(selector, "resume")["would_resume"] == len(tenant_a)

    resumed = store.resume_messages(selector)
    assert sorted(resumed["resumed"]) == tenant_a and resumed["counts"]["resumed"] == len(tenant_a)
    assert store.next_due() < store.clock()
    with store.claim_due(store.clock(), limit=100) as claim:
        assert sorted(m.message_id for m in claim.messages) == [i for i in tenant_a if i != "t-later"]
    assert store.get("t-later").due_at == sent[-1].due_at and not store.browse(Selector())["messages"][-1]["held"]


def test_paused_ids_are_reported_each_and_stay_paused_through_a_reschedule_an_edit_and_a_resend(store):
    _tenants(store, 4)
    report = store.pause_messages(Selector.build(message_ids=["t-0", "t-1", "t-2", "nope"]))
    assert (sorted(report["paused"]), report["unknown"]) == (["t-0", "t-1", "t-2"], ["nope"])
    # By ids, one already paused is reported paused again (a repeated action reports the same).
    assert store.pause_messages(Selector.build(message_ids=["t-0"]))["paused"] == ["t-0"]
    now = store.clock()
    assert store.reschedule(Selector.build(message_ids=["t-0"]), now)["rescheduled"] == ["t-0"]
    assert store.edit("t-1", body=b"edited")["edited"] == ["t-1"]
    store.store([DelayedMessage("orders", b"resent", now - timedelta(seconds=30), {"tenant": "a"}, "t-2")],
                on_duplicate="replace")
    with store.claim_due(store.clock(), limit=100) as claim:
        assert [m.message_id for m in claim.messages] == ["t-3"]
        claim.remove(["t-3"])
    held = {m["message_id"]: m for m in store.browse(Selector(), limit=10)["messages"] if m["held"]}
    assert sorted(held) == ["t-0", "t-1", "t-2"]
    assert store.get("t-2").body == b"resent" and store.get("t-1").body == b"edited"
    # A cancel takes a paused message as any other; a resume by ids reports one that was not paused as resumed.
    assert store.cancel(Selector.build(message_ids=["t-1"]))["cancelled"] == ["t-1"]
    resumed = store.resume_messages(Selector.build(message_ids=["t-0", "t-2", "t-later", "t-1"]))
    assert sorted(resumed["resumed"]) == ["t-0", "t-2", "t-later"] and resumed["gone"] == ["t-1"]
    with store.claim_due(store.clock(), limit=100) as claim:
        assert sorted(m.message_id for m in claim.messages) == ["t-0", "t-2"]


def test_a_paused_destination_is_purged_and_forgotten_with_its_paused_messages(store):
    _tenants(store, 4)
    store.pause_messages(Selector.build(destination="orders"))
    with pytest.raises(InvalidInputError, match="scheduled"):
        store.forget_destinations(["orders"])
    assert store.purge("orders", dry_run=True)["would_purge"] == 5
    assert store.purge("orders", dry_run=False)["purged"] == 5
    assert store.count_scheduled() == {} and store.backlog()["totals"]["held"] == 0

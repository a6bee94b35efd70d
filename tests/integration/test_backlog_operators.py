"""The backlog controls from a DAG (the operators, templated from a send task's XCom) and from the
`airflow delayed-messages` command line, on the real PostgreSQL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from airflow_delay_provider.core.backlog import Selector
from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from tests.conftest import PG_URL
from tests.integration.test_airflow import _pg_conn

START = datetime(2026, 1, 1)


@pytest.fixture
def pg_store(pg_schema, monkeypatch):
    table = f"b_{uuid.uuid4().hex[:10]}"
    conn_id = _pg_conn(monkeypatch, pg_schema, table, password="s3cr3t-pw")
    store = SqlDelayedMessageStore(PG_URL, table=table, schema=pg_schema)
    store.create_schema()
    return conn_id, store


def test_operators_cancel_reschedule_pause_and_purge_what_a_send_task_scheduled(run_dag, pg_store):
    from airflow.sdk import DAG

    from airflow_delay_provider.operators.backlog import (
        CancelDelayedMessagesOperator,
        PauseDestinationOperator,
        PurgeDelayedMessagesOperator,
        RescheduleDelayedMessagesOperator,
        ResumeDestinationOperator,
    )
    from airflow_delay_provider.operators.send import SendDelayedMessageOperator

    conn_id, store = pg_store
    store_args = {"delay_store_conn_id": conn_id}
    with DAG(f"backlog_ops_{uuid.uuid4().hex[:6]}", schedule=None, start_date=START) as dag:
        send = SendDelayedMessageOperator(task_id="send", **store_args, messages=[
            {"destination": "orders", "body": f"order {i}", "headers": {"order-id": str(i)}, "delay_seconds": 3600}
            for i in range(4)])
        cancel = CancelDelayedMessagesOperator(
            task_id="cancel", **store_args, message_ids="{{ ti.xcom_pull(task_ids='send')[:2] }}")
        cancel_again = CancelDelayedMessagesOperator(
            task_id="cancel_again", **store_args, message_ids="{{ ti.xcom_pull(task_ids='send')[0] }}")
        run_now = RescheduleDelayedMessagesOperator(task_id="run_now", **store_args, headers={"order-id": "2"},
                                                    delay_seconds="{{ 0 }}")
        pause = PauseDestinationOperator(task_id="pause", **store_args, destinations="orders")
        resume = ResumeDestinationOperator(task_id="resume", **store_args, destinations=["orders"])
        dry = PurgeDelayedMessagesOperator(task_id="dry", **store_args, destination="orders")
        send >> cancel >> cancel_again >> run_now >> pause >> resume >> dry
    state, states, values = run_dag(dag)
    assert state == "success", states
    ids = values["send"]
    assert sorted(values["cancel"]["cancelled"]) == sorted(ids[:2])
    assert values["cancel_again"]["gone"] == [ids[0]] and values["cancel_again"]["cancelled"] == []
    assert values["run_now"]["rescheduled"] == [ids[2]]
    assert values["pause"] == {"paused": True, "changed": ["orders"], "unchanged": []}
    assert values["resume"]["changed"] == ["orders"]
    assert values["dry"] == {"destination": "orders", "dry_run": True, "would_purge": 2, "in_flight": 0}
    assert store.get(ids[2]).due_at <= store.clock()
    assert store.get(ids[3]) is not None and store.get(ids[0]) is None


def test_operators_count_guard_and_change_by_a_filter(run_dag, pg_store):
    """By a body text (templated) and a due window: a dry run counts, `max_messages` fails the task before anything
    changes when more match, and the change then goes by the same filter."""
    from airflow.sdk import DAG

    from airflow_delay_provider.operators.backlog import (
        CancelDelayedMessagesOperator,
        RescheduleDelayedMessagesOperator,
    )
    from airflow_delay_provider.operators.send import SendDelayedMessageOperator

    conn_id, store = pg_store
    store_args = {"delay_store_conn_id": conn_id}
    with DAG(f"backlog_filter_{uuid.uuid4().hex[:6]}", schedule=None, start_date=START) as dag:
        send = SendDelayedMessageOperator(task_id="send", **store_args, messages=[
            {"destination": "orders", "body": f"{'vip' if i % 2 else 'plain'} order {i}",
             "delay_seconds": 600 * (i + 1)} for i in range(6)])
        count = CancelDelayedMessagesOperator(task_id="count", **store_args, body_contains="{{ 'vip' }}",
                                              dry_run=True)
        guard = CancelDelayedMessagesOperator(task_id="guard", **store_args, body_contains="vip", max_messages=2)
        cancel = CancelDelayedMessagesOperator(task_id="cancel", **store_args, body_contains="vip", max_messages=3)
        later = RescheduleDelayedMessagesOperator(
            task_id="later", **store_args, destination="orders", due_from="{{ macros.datetime.now(macros.dateutil."
            "tz.UTC).isoformat() }}", due_before="{{ (macros.datetime.now(macros.dateutil.tz.UTC) + "
            "macros.timedelta(seconds=1900)).isoformat() }}", delay_seconds=7200)
        send >> [count, guard]
        count >> cancel >> later
    state, states, values = run_dag(dag)
    assert states["guard"] == "failed" and all(states[t] == "success" for t in ("send", "count", "cancel", "later"))
    ids = values["send"]
    assert (values["count"]["dry_run"], values["count"]["would_cancel"]) == (True, 3)
    assert sorted(values["cancel"]["cancelled"]) == sorted(ids[1::2])
    # Due in 10, 30 and 50 minutes were the plain ones; the window of 1,900 s holds the first two.
    assert sorted(values["later"]["rescheduled"]) == sorted([ids[0], ids[2]])
    assert store.get(ids[4]).due_at < store.get(ids[0]).due_at


def test_operators_pause_what_a_filter_matches_guarded_and_resume_it(run_dag, pg_store):
    """A dry run counts `would_pause`, `max_messages` fails the task before anything changes, the pause holds what
    matches (a templated header), and the resume by the send task's ids releases it."""
    from airflow.sdk import DAG

    from airflow_delay_provider.operators.backlog import PauseDelayedMessagesOperator, ResumeDelayedMessagesOperator
    from airflow_delay_provider.operators.send import SendDelayedMessageOperator

    conn_id, store = pg_store
    store_args = {"delay_store_conn_id": conn_id}
    with DAG(f"backlog_hold_{uuid.uuid4().hex[:6]}", schedule=None, start_date=START) as dag:
        send = SendDelayedMessageOperator(task_id="send", **store_args, messages=[
            {"destination": "orders", "body": f"order {i}", "headers": {"tenant": "ab"[i % 2]}, "delay_seconds": 60}
            for i in range(6)])
        count = PauseDelayedMessagesOperator(task_id="count", **store_args, headers={"tenant": "a"}, dry_run=True)
        guard = PauseDelayedMessagesOperator(task_id="guard", **store_args, headers={"tenant": "a"}, max_messages=2)
        pause = PauseDelayedMessagesOperator(task_id="pause", **store_args, headers="{{ {'tenant': 'a'} }}")
        resume = ResumeDelayedMessagesOperator(task_id="resume", **store_args,
                                               message_ids="{{ ti.xcom_pull(task_ids='send')[:2] }}")
        send >> [count, guard]
        count >> pause >> resume
    state, states, values = run_dag(dag)
    assert states["guard"] == "failed" and all(states[t] == "success" for t in ("send", "count", "pause", "resume"))
    ids = values["send"]
    assert values["count"]["would_pause"] == 3
    assert sorted(values["pause"]["paused"]) == sorted(ids[0::2]) and values["pause"]["counts"]["paused"] == 3
    # By ids, one that was not paused (ids[1]) is reported resumed as well: it is where a resume puts it.
    assert sorted(values["resume"]["resumed"]) == sorted(ids[:2])
    held = {m["message_id"] for m in store.browse(Selector(), limit=10)["messages"] if m["held"]}
    assert held == {ids[2], ids[4]}


def test_an_empty_or_unknown_selector_fails_at_parse_or_run_time(run_dag, pg_store):
    from airflow.sdk import DAG

    from airflow_delay_provider.operators.backlog import CancelDelayedMessagesOperator, PauseDestinationOperator

    conn_id, store = pg_store
    with pytest.raises(InvalidInputError, match="would apply to every message"):
        CancelDelayedMessagesOperator(task_id="c", delay_store_conn_id=conn_id)
    with pytest.raises(InvalidInputError, match="at least one destination"):
        PauseDestinationOperator(task_id="p", delay_store_conn_id=conn_id, destinations=[])
    store.store([])
    with DAG(f"backlog_bad_{uuid.uuid4().hex[:6]}", schedule=None, start_date=START) as dag:
        # The template renders to nothing (no such XCom): refused when the task runs, nothing cancelled.
        CancelDelayedMessagesOperator(task_id="cancel", delay_store_conn_id=conn_id,
                                      message_ids="{{ ti.xcom_pull(task_ids='missing') or '' }}")
    state, states, _ = run_dag(dag)
    assert states["cancel"] == "failed"


def _cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "airflow"), "delayed-messages", *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_the_command_line_lists_cancels_pauses_and_purges_without_showing_the_password(
        airflow_home, pg_store, monkeypatch):
    conn_id, store = pg_store
    from datetime import timedelta

    from airflow_delay_provider.core.delays import utcnow
    from airflow_delay_provider.core.message import DelayedMessage

    store.store([DelayedMessage("orders", b"hello", utcnow() + timedelta(seconds=600 + i), {"order-id": str(i)},
                                message_id=f"cli-{i}") for i in range(3)])
    env = {**os.environ}
    base = ("--conn-id", conn_id)
    listed = _cli("browse", *base, "--destination", "orders", "--limit", "2", env=env)
    assert listed.returncode == 0, listed.stderr
    page = json.loads(listed.stdout)
    assert [m["message_id"] for m in page["messages"]] == ["cli-0", "cli-1"] and page["next"]
    counts = json.loads(_cli("backlog", *base, env=env).stdout)
    assert counts["destinations"]["orders"]["histogram"]["next_hour"] == 3

    cancelled = json.loads(_cli("cancel", *base, "--id", "cli-0,nope", env=env).stdout)
    assert cancelled["cancelled"] == ["cli-0"] and cancelled["unknown"] == ["nope"]
    by_header = json.loads(_cli("run-now", *base, "--header", "order-id=2", env=env).stdout)
    assert by_header["rescheduled"] == ["cli-2"]
    assert json.loads(_cli("pause", *base, "orders", env=env).stdout)["changed"] == ["orders"]
    assert json.loads(_cli("purge", *base, "--destination", "orders", env=env).stdout)["would_purge"] == 2
    assert json.loads(_cli("purge", *base, "--destination", "orders", "--yes", env=env).stdout)["purged"] == 2
    assert store.count_scheduled() == {}

    refused = _cli("cancel", *base, env=env)
    assert refused.returncode == 1 and "would apply to every message" in refused.stderr
    unknown = _cli("pause", *base, "ordres", env=env)
    assert unknown.returncode == 1 and "unknown destination(s) ['ordres']" in unknown.stderr
    for result in (listed, refused, unknown):
        assert "s3cr3t-pw" not in result.stdout + result.stderr


def test_the_command_line_piped_into_head_ends_quietly_and_a_missing_connection_names_its_variable(
        airflow_home, pg_store):
    conn_id, store = pg_store
    from airflow_delay_provider.core.delays import utcnow
    from airflow_delay_provider.core.message import DelayedMessage

    store.store([DelayedMessage("orders", b"x" * 200, utcnow() + timedelta(hours=1), message_id=f"pipe-{i}")
                 for i in range(1000)])
    airflow = str(Path(sys.executable).parent / "airflow")
    # `airflow delayed-messages browse ... | head -n 1`: the reader closes the pipe after one line.
    with subprocess.Popen([airflow, "delayed-messages", "browse", "--conn-id", conn_id, "--limit", "1000"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ}) as cli:
        assert cli.stdout.readline().strip() == b"{"
        cli.stdout.close()
        stderr = cli.stderr.read().decode()
        assert cli.wait(120) == 0, stderr
    assert "BrokenPipeError" not in stderr and "Traceback" not in stderr, stderr

    refused = _cli("forget", "--conn-id", conn_id, "orders", env={**os.environ})
    assert refused.returncode == 1 and "still have scheduled messages {'orders': 1000}" in refused.stderr
    forgot = json.loads(_cli("forget", "--conn-id", conn_id, "orders", "--force", env={**os.environ}).stdout)
    assert forgot["forgotten"] == ["orders"] and forgot["purged"] == {"orders": 1000}
    assert "orders" not in store.destinations() and store.count_scheduled() == {}

    missing = _cli("backlog", "--conn-id", "delay_store_other", env={**os.environ})
    assert missing.returncode == 1
    assert "AIRFLOW_CONN_DELAY_STORE_OTHER=" in missing.stderr, missing.stderr
    assert "AIRFLOW_CONN_DELAY_STORE_DEFAULT" not in missing.stderr

"""`airflow delayed-messages` as a user runs it, on SQLite and the real PostgreSQL: the destination as --destination
everywhere (purge's positional kept, deprecated), `--output table|json|yaml|plain` with a table on a terminal and
JSON in a pipe, errors naming the flags, and `dead-letters delete` (a dry run without --yes; refusing a store that
is not there, creating nothing)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pty
import re
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
import yaml
from sqlalchemy import create_engine, text

from airflow_delay_provider.core.backlog import Selector
from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.pump import Pump, PumpConfig
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from airflow_delay_provider.transports.sql import SqlTableTransport
from tests.conftest import PG_URL
from tests.integration.test_airflow import _pg_conn

AIRFLOW = str(Path(sys.executable).parent / "airflow")


def _process(*args: str) -> subprocess.CompletedProcess:
    """One command in a process of its own, with stdout a pipe (as a script reads it)."""
    return subprocess.run([AIRFLOW, "delayed-messages", *args], capture_output=True, text=True, env={**os.environ},
                          timeout=180)


def _cli(*args: str) -> subprocess.CompletedProcess:
    """One command parsed by Airflow's own command line and run in this process, stdout not a terminal: what the
    `airflow` program does after its start-up (about 3 s of CPU each, which `_process` pays; the tests that need a
    process of its own, a terminal or the exit status as the shell sees it, use that)."""
    from airflow.cli.cli_parser import get_parser

    out, err, code = io.StringIO(), io.StringIO(), 0
    argv = ["airflow", "delayed-messages", *args]  # a dry run's confirming command repeats the command line
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), mock.patch.object(sys, "argv", argv):
        try:
            parsed = get_parser().parse_args(["delayed-messages", *args])
            parsed.func(parsed)
        except SystemExit as exc:  # as the interpreter reports it: a text on stderr with status 1, else the code
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
                code = 1
            else:
                code = exc.code or 0
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def _ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, (result.args, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    return result


def _refused(result: subprocess.CompletedProcess, *said: str) -> str:
    """A user error: exit status 1, one line on stderr saying what, no traceback, no report on stdout."""
    assert result.returncode == 1, (result.args, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and result.stdout == "", (result.stdout, result.stderr)
    for words in said:
        assert words in result.stderr, (words, result.stderr)
    return result.stderr


def _sqlite_store(tmp_path: Path, monkeypatch) -> tuple[str, SqlDelayedMessageStore, SqlTableTransport]:
    path = tmp_path / "store.db"
    conn_id = f"cli_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(
        {"conn_type": "delay_store", "schema": str(path), "extra": {"driver": "sqlite"}}))
    return conn_id, _store(f"sqlite:///{path}", None, "delayed_messages"), SqlTableTransport(f"sqlite:///{path}")


def _store(url: str, schema: str | None, table: str) -> SqlDelayedMessageStore:
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    store.create_schema()
    return store


@pytest.fixture(params=["sqlite", "postgres"])
def where(request, tmp_path, monkeypatch, airflow_home):
    """(conn_id, store, queues): a store and its SQL-table queues (the same database) behind a connection."""
    if request.param == "sqlite":
        return _sqlite_store(tmp_path, monkeypatch)
    schema, table = request.getfixturevalue("pg_schema"), f"c_{uuid.uuid4().hex[:10]}"
    return _pg_conn(monkeypatch, schema, table), _store(PG_URL, schema, table), SqlTableTransport(PG_URL, schema=schema)


@pytest.fixture
def on_sqlite(tmp_path, monkeypatch, airflow_home):
    """As `where`, on SQLite only: for what does not depend on the database."""
    return _sqlite_store(tmp_path, monkeypatch)


def _schedule(store: SqlDelayedMessageStore, destination: str, n: int) -> list[str]:
    ids = [f"{destination}-{i}" for i in range(n)]
    store.store([DelayedMessage(destination, b"hello", utcnow() + timedelta(minutes=5 + i), {"k": str(i)}, mid)
                 for i, mid in enumerate(ids)])
    return ids


def test_purge_takes_destination_as_a_flag_and_every_command_prints_each_output_format(where):
    conn_id, store, _ = where
    destination = f"orders_{uuid.uuid4().hex[:6]}"
    ids = _schedule(store, destination, 3)
    base = ("--conn-id", conn_id)

    piped = _ok(_cli("purge", *base, "--destination", destination))  # no --output, stdout a pipe: JSON
    assert json.loads(piped.stdout) == {"destination": destination, "dry_run": True, "would_purge": 3, "in_flight": 0}
    assert "deprecated" not in piped.stderr
    assert (f"Dry run: nothing was purged; 3 scheduled message(s) would be. To purge them: airflow delayed-messages "
            f"purge --conn-id {conn_id} --destination {destination} --yes") in piped.stderr, piped.stderr
    old_style = _ok(_cli("purge", *base, destination, "-o", "yaml"))  # as scripts wrote it before --destination
    assert yaml.safe_load(old_style.stdout)["would_purge"] == 3
    assert f"`purge DESTINATION` is deprecated: write `purge --destination {destination}`" in old_style.stderr

    table = _ok(_cli("browse", *base, "--destination", destination, "--output", "table")).stdout.splitlines()
    assert re.split(r"\s*\|\s*", table[0])[:3] == ["message_id", "destination", "due_at"], table[0]
    assert set(table[1]) <= {"=", "+"}, table[1]  # the header's rule, as Airflow's own tables have it
    assert [line.split("|")[0].strip() for line in table[2:5]] == ids
    assert any(line.startswith("next ") for line in table), table  # the page's cursor, below the messages
    plain = _ok(_cli("backlog", *base, "-o", "plain")).stdout.splitlines()
    assert plain[0].split()[:3] == ["destination", "scheduled", "due"], plain
    assert plain[1].split()[:2] == [destination, "3"], plain
    assert not any("label" in line for line in plain)  # the page's histogram labels are left to json/yaml

    purged = _ok(_cli("purge", *base, "--destination", destination, "--yes", "-o", "json"))
    assert json.loads(purged.stdout)["purged"] == 3 and store.count_scheduled() == {}


def test_a_table_on_a_terminal_and_json_in_a_pipe_by_default(on_sqlite):
    conn_id, store, _ = on_sqlite
    ids = _schedule(store, "orders", 2)
    # stdout a terminal, as when a user types the command
    leader, follower = pty.openpty()
    try:
        done = subprocess.run([AIRFLOW, "delayed-messages", "browse", "--conn-id", conn_id], stdout=follower,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "250"}, timeout=180)
        os.close(follower)
        shown = b""
        while chunk := _read(leader):
            shown += chunk
    finally:
        os.close(leader)
    assert done.returncode == 0, done.stderr
    screen = re.sub(r"\x1b\[[0-9;]*m", "", shown.decode())  # colours, if the terminal gets any
    assert re.search(r"message_id\s*\|\s*destination", screen), screen
    assert all(re.search(rf"^{mid}\s*\|\s*orders", screen, re.MULTILINE) for mid in ids), screen
    assert not screen.lstrip().startswith("{")
    piped = _ok(_process("browse", "--conn-id", conn_id))  # the same command in a pipe
    assert [m["message_id"] for m in json.loads(piped.stdout)["messages"]] == ids


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:  # Linux: EIO once the other end is closed and everything was read
        return b""


def test_errors_name_the_flags_and_what_is_allowed(on_sqlite):
    conn_id, _, _ = on_sqlite
    base = ("--conn-id", conn_id)
    # As the shell sees it, from a process of its own: exit status 1, one line, no traceback.
    everything = _refused(_process("cancel", *base), "select messages with --id, --destination, --header KEY=VALUE, "
                          "--body-contains or a due window (--due-from, --due-before)")
    too_many = _refused(_cli("browse", *base, "--limit", "5000"), "--limit must be an int in 1..1000, got 5000")
    neither = _refused(_cli("reschedule", *base, "--id", "x"), "give exactly one of --deliver-at (a time) or "
                       "--delay-seconds (0 runs it now)")
    no_destination = _refused(_cli("purge", *base), "purge needs --destination DESTINATION")
    for said in (everything, too_many, neither, no_destination):
        assert not re.search(r"(?<![-\w])(message_ids|deliver_at|delay_seconds|limit must)\b", said), said


def _dead_letter(store: SqlDelayedMessageStore, queues: SqlTableTransport, error_queue: str) -> dict[str, list[str]]:
    """Dead letters written by the pump: messages for destinations never provisioned, per destination."""
    queues.create_schema()
    queues.provision(error_queue)
    lost = {f"lost_{uuid.uuid4().hex[:6]}": 3, f"gone_{uuid.uuid4().hex[:6]}": 2}
    ids = {name: [f"{name}-{i}" for i in range(n)] for name, n in lost.items()}
    past = utcnow() - timedelta(seconds=1)
    store.store([DelayedMessage(name, b"x", past, {}, mid) for name, mids in ids.items() for mid in mids])
    result = Pump(store, queues, PumpConfig(error_queue=error_queue), sleep=lambda _: None).run(stop_when_idle=True)
    assert result.stats.dead_lettered == 5 and queues.depth(error_queue)["visible"] == 5
    return ids


def test_dead_letters_delete_is_a_dry_run_without_yes_and_deletes_by_destination_id_and_all(where):
    conn_id, store, queues = where
    error_queue = f"err_{uuid.uuid4().hex[:8]}"
    ids = _dead_letter(store, queues, error_queue)
    lost, gone = list(ids)
    base = ("--conn-id", conn_id, "--error-queue", error_queue)

    dry = _ok(_cli("dead-letters", "delete", *base, "--destination", lost))
    report = json.loads(dry.stdout)
    assert (report["dry_run"], report["would_delete"]) == (True, 3)
    assert sorted(d["message_id"] for d in report["dead_letters"]) == ids[lost]
    assert {d["destination"] for d in report["dead_letters"]} == {lost}
    assert "nothing was deleted; 3 dead letter(s) would be" in dry.stderr
    assert (f"To delete them: airflow delayed-messages dead-letters delete --conn-id {conn_id} --error-queue "
            f"{error_queue} --destination {lost} --yes") in dry.stderr, dry.stderr
    assert queues.depth(error_queue)["visible"] == 5  # a dry run deletes nothing

    by_destination = json.loads(_ok(_cli("dead-letters", "delete", *base, "--destination", lost, "--yes")).stdout)
    assert (by_destination["deleted"], by_destination["destinations"], by_destination["left"]) == (3, {lost: 3}, 2)
    assert queues.depth(error_queue) == {"visible": 2, "in_flight": 0}  # the others given back at once
    by_id = _ok(_cli("dead-letters", "delete", *base, "--id", f"{ids[gone][0]},nope", "--yes", "-o", "plain"))
    assert re.search(r"^deleted\s+1\s*$", by_id.stdout, re.MULTILINE), by_id.stdout
    assert [m.message_id for m in queues.peek(error_queue, 10)] == [ids[gone][1]]
    rest = json.loads(_ok(_cli("dead-letters", "delete", *base, "--all", "--yes")).stdout)
    assert (rest["deleted"], rest["destinations"]) == (1, {gone: 1})
    assert queues.depth(error_queue) == {"visible": 0, "in_flight": 0}
    listing = json.loads(_ok(_cli("dead-letters", *base)).stdout)  # `dead-letters` alone still lists
    assert listing["count"] == 0 and listing["error_queue"] == error_queue


def test_dead_letters_delete_refuses_a_store_that_is_not_there_and_creates_nothing(where, tmp_path, monkeypatch):
    conn_id, store, _ = where
    if store.is_postgres:
        typo = f"{store.schema}_typo"
        result = _cli("dead-letters", "delete", "--conn-id", conn_id, "--db-schema", typo, "--all", "--yes")
        _refused(result, f"schema {typo!r}", "has no tables yet", "airflow delayed-messages db upgrade")
        engine = create_engine(PG_URL)
        try:
            with engine.connect() as conn:
                assert not conn.execute(text("SELECT count(*) FROM pg_namespace WHERE nspname = :s"),
                                        {"s": typo}).scalar()
        finally:
            engine.dispose()
    else:
        path = tmp_path / "tpyo.db"
        missing = f"cli_{uuid.uuid4().hex[:8]}"
        monkeypatch.setenv(f"AIRFLOW_CONN_{missing.upper()}", json.dumps(
            {"conn_type": "delay_store", "schema": str(path), "extra": {"driver": "sqlite"}}))
        for yes in ((), ("--yes",)):
            result = _cli("dead-letters", "delete", "--conn-id", missing, "--all", *yes)
            _refused(result, f"connection {missing!r}", "has no tables yet", "airflow delayed-messages db upgrade")
            assert not path.exists()


def test_edit_changes_a_scheduled_messages_body_and_headers_and_says_what_it_did(on_sqlite):
    conn_id, store, _ = on_sqlite
    [message_id] = _schedule(store, "orders", 1)
    due = store.get(message_id).due_at
    edited = json.loads(_ok(_cli("edit", "--conn-id", conn_id, message_id, "--body", '{"qty": 2}',
                                 "--set-header", "k=new", "--set-header", "reason=typo", "-o", "json")).stdout)
    assert edited["edited"] == [message_id] and edited["counts"]["edited"] == 1
    now = store.get(message_id)
    assert (now.body, now.headers, now.due_at) == (b'{"qty": 2}', {"k": "new", "reason": "typo"}, due)
    _refused(_cli("edit", "--conn-id", conn_id, message_id, "--set-header", "no-equals-sign"),
             "--set-header takes KEY=VALUE, got 'no-equals-sign'")
    _refused(_cli("edit", "--conn-id", conn_id, message_id), "an edit needs a new body and/or new headers")
    gone = json.loads(_ok(_cli("edit", "--conn-id", conn_id, "never-sent", "--body", "x", "-o", "json")).stdout)
    assert gone["edited"] == [] and gone["unknown"] == ["never-sent"]
    assert store.get(message_id).body == b'{"qty": 2}'


def test_a_cancel_by_a_filter_counts_first_and_asks_above_a_thousand(on_sqlite, monkeypatch):
    """--dry-run counts; a filter over 1,000 messages is refused in a pipe without --yes and asked on a terminal;
    a smaller one goes at once; the audit log records the changes with their filter, not the counts."""
    from airflow_delay_provider import audit
    from airflow_delay_provider.core.backlog import CONFIRM_ABOVE

    conn_id, store, _ = on_sqlite
    now = utcnow()
    store.store([DelayedMessage("orders", b"vip order" if i % 2 else b"plain order", now + timedelta(minutes=5 + i),
                                {}, f"o-{i}") for i in range(2 * CONFIRM_ABOVE + 4)])
    base = ("--conn-id", conn_id, "-o", "json")
    counted = _ok(_cli("cancel", *base, "--body-contains", "vip", "--dry-run"))
    report = json.loads(counted.stdout)
    assert (report["would_cancel"], report["confirm"]) == (CONFIRM_ABOVE + 2, True)
    assert "Dry run: nothing was changed; 1002 scheduled message(s) would be" in counted.stderr
    assert "--dry-run" not in counted.stderr.rpartition("To do it:")[2]
    _refused(_cli("cancel", *base, "--body-contains", "vip"), "Cancel 1,002 scheduled messages (body-contains vip)?",
             "run it again with --yes")
    assert store.count_selected(Selector.build(body_contains="vip"))["would_cancel"] == CONFIRM_ABOVE + 2
    # On a terminal it asks; "n" changes nothing, "y" cancels.
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda question: "n")
    _refused(_cli("cancel", *base, "--body-contains", "vip"), "nothing was changed")
    monkeypatch.setattr("builtins.input", lambda question: "y")
    done = json.loads(_ok(_cli("cancel", *base, "--body-contains", "vip")).stdout)
    assert done["counts"] == {"cancelled": CONFIRM_ABOVE + 2, "in_flight": 0} and done["truncated"]
    # A small filter goes at once; a due window alone is a filter too.
    later = (now + timedelta(minutes=5 + 2 * CONFIRM_ABOVE)).isoformat()
    moved = json.loads(_ok(_cli("run-now", *base, "--due-from", later)).stdout)
    assert moved["counts"]["rescheduled"] == 2
    assert store.count_scheduled() == {"orders": CONFIRM_ABOVE + 2}
    recorded = [a for a in audit.recent(10, conn_id) if a["action"] in ("cancel", "run_now")]
    assert [(a["action"], a["counts"]) for a in recorded] == [("run_now", {"rescheduled": 2}),
                                                              ("cancel", {"cancelled": CONFIRM_ABOVE + 2})]
    assert recorded[1]["target"]["body_contains"] == "vip" and recorded[0]["target"]["due_from"] == later


def test_pause_messages_by_a_filter_counts_first_holds_them_and_resume_messages_releases_them(where):
    """On both databases: a dry run counts, the pause holds what matches (the backlog counts it held, a claim passes
    over it), a resume by ids and one by the filter release it; the audit log has both with their counts."""
    from airflow_delay_provider import audit

    conn_id, store, _ = where
    now = utcnow()
    store.store([DelayedMessage("orders", b"x", now - timedelta(seconds=5), {"tenant": "ab"[i % 2]}, f"t-{i}")
                 for i in range(6)])
    base = ("--conn-id", conn_id, "-o", "json")
    counted = _ok(_cli("pause-messages", *base, "--header", "tenant=a", "--dry-run"))
    assert json.loads(counted.stdout)["would_pause"] == 3 and "3 scheduled message(s) would be" in counted.stderr
    paused = json.loads(_ok(_cli("pause-messages", *base, "--header", "tenant=a")).stdout)
    assert sorted(paused["paused"]) == ["t-0", "t-2", "t-4"] and paused["counts"]["already_paused"] == 0
    backlog = json.loads(_ok(_cli("backlog", *base)).stdout)
    assert backlog["destinations"]["orders"]["held"] == 3
    with store.claim_due(utcnow(), 10) as claim:
        assert sorted(m.message_id for m in claim.messages) == ["t-1", "t-3", "t-5"]
    one = json.loads(_ok(_cli("resume-messages", *base, "--id", "t-2")).stdout)
    assert one["resumed"] == ["t-2"]
    rest = json.loads(_ok(_cli("resume-messages", *base, "--header", "tenant=a", "--destination", "orders")).stdout)
    assert sorted(rest["resumed"]) == ["t-0", "t-4"]
    _refused(_cli("pause-messages", *base), "would apply to every message")
    recorded = [(a["action"], a["counts"]) for a in audit.recent(10, conn_id) if a["action"].endswith("_messages")]
    assert recorded == [("resume_messages", {"resumed": 2}), ("resume_messages", {"resumed": 1, "unknown": 0}),
                        ("pause_messages", {"paused": 3})]


def test_history_lateness_and_story_show_what_became_of_messages_without_writing(where):
    conn_id, store, queues = where
    destination = f"orders_{uuid.uuid4().hex[:6]}"
    queues.create_schema()
    queues.provision(destination)
    due = utcnow() - timedelta(seconds=2)
    store.store([DelayedMessage(destination, b"secret", due, {}, f"{destination}-{i}") for i in range(3)]
                + [DelayedMessage(destination, b"secret", utcnow() + timedelta(hours=1), {}, "later-1")])
    assert Pump(store, queues, PumpConfig()).run(stop_when_idle=True).stats.dispatched == 3
    base = ("--conn-id", conn_id)

    listed = json.loads(_ok(_cli("history", *base, "--destination", destination)).stdout)
    assert sorted(e["message_id"] for e in listed["entries"]) == [f"{destination}-{i}" for i in range(3)]
    assert {e["outcome"] for e in listed["entries"]} == {"delivered"} and listed["history_days"] == 7
    assert all(e["lateness_ms"] >= 2000 for e in listed["entries"]) and "secret" not in json.dumps(listed)
    page = json.loads(_ok(_cli("history", *base, "--limit", "2")).stdout)
    rest = json.loads(_ok(_cli("history", *base, "--limit", "2", "--after", page["next"])).stdout)
    assert len(page["entries"]) == 2 and len(rest["entries"]) == 1 and rest["next"] is None

    minutes = json.loads(_ok(_cli("lateness", *base, "--destination", destination, "--window", "6h")).stdout)
    assert sum(m["delivered"] for m in minutes["minutes"]) == 3 and minutes["window"] == "6h"
    table = _ok(_cli("lateness", *base, "-o", "table")).stdout
    assert "p99_ms" in table.splitlines()[0], table

    story = json.loads(_ok(_cli("story", *base, f"{destination}-1")).stdout)
    assert story["state"] == "delivered" and [h["attempts"] for h in story["history"]] == [1]
    scheduled = json.loads(_ok(_cli("story", *base, "later-1")).stdout)
    assert scheduled["state"] == "scheduled" and scheduled["scheduled"]["body"] == "secret"
    assert "body" not in json.loads(_ok(_cli("story", *base, "later-1", "--no-bodies")).stdout)["scheduled"]

    _refused(_cli("history", *base, "--since", "yesterday"), "since must be an ISO-8601 timestamp")
    _refused(_cli("history", *base, "--after", "nope"), "after must be the `next` cursor")
    assert store.count_scheduled() == {destination: 1}  # reading changed nothing

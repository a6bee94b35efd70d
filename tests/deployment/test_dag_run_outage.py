"""Delayed DAG runs through a store outage, in a real deployment: the triggerer reaches the store's PostgreSQL
through a TCP proxy (tests/faults/proxy.py), which cuts every connection and refuses new ones for a few seconds
right after a message was handed over, while its event is being recorded and acknowledged. The producer rides
the outage out: each message starts exactly one DAG run, none is lost."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import select

from airflow_delay_provider.core.message import DelayedMessage
from tests.conftest import PG_URL
from tests.deployment.rig import wait_for
from tests.faults.proxy import TcpProxy
from tests.helpers import store_connection

TARGET = "outage_target"
ASSET = f"delayed_dag_run.{TARGET}"
DEST = f"airflow.asset.{ASSET}"
#: Each outage: long enough for the acknowledgement of the event handed over just before to fail, shorter than
#: the lease (renewed every third of it), so the claim outlives it.
OUTAGE_SECONDS = 6.0
LEASE_SECONDS = 15

TARGET_DAG = f'''
import itertools
from datetime import datetime

from airflow.sdk import DAG, task

from airflow_delay_provider.triggers.asset import dag_run_asset, message_payloads

with DAG(dag_id="{TARGET}", schedule=dag_run_asset("{TARGET}", lease_seconds={LEASE_SECONDS}),
         start_date=datetime(2026, 1, 1), catchup=False):

    @task
    def handle(triggering_asset_events=None) -> list[str]:
        return [p["message_id"] for p in message_payloads(itertools.chain(*triggering_asset_events.values()))]

    handle()
'''


@pytest.fixture(scope="module")
def proxy():
    with TcpProxy(5432, name="triggerer-store") as proxy:
        yield proxy


@pytest.fixture(scope="module")
def airflow(proxy, deployment, tmp_path_factory, pg_schema, store):  # the proxy outlives the deployment
    dags = tmp_path_factory.mktemp("outage_dags")
    (dags / f"{TARGET}.py").write_text(TARGET_DAG)
    direct = store_connection(PG_URL, pg_schema)
    # Only the triggerer (where the asset watcher's producer runs) goes through the proxy.
    through_proxy = {"AIRFLOW_CONN_DELAY_STORE_DEFAULT": json.dumps({**direct, "port": proxy.port})}
    rig = deployment(dags, connections={"delay_store_default": direct}, component_env={"triggerer": through_proxy},
                     env={"AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "5"}, expected_dags=[TARGET])
    rig.unpause(TARGET)
    wait_for(lambda: store.event_claims(DEST), 120, "the target's asset watcher to start in the triggerer")
    return rig




def _holder(store, message_id: str) -> str | None:
    """The claim holding the message (it was handed over), or None; "gone" once it was acknowledged."""
    t = store.table
    with store.engine.connect() as conn:
        row = conn.execute(select(t.c.claim_id).where(t.c.message_id == message_id)).first()
    return "gone" if row is None else row.claim_id


def _handled(airflow) -> dict[str, list[str]]:
    """Message id -> the finished target runs that handled it."""
    runs: dict[str, list[str]] = {}
    for run in airflow.dag_runs(TARGET, run_type="asset_triggered"):
        if run["state"] in ("success", "failed"):
            for message_id in airflow.xcom(TARGET, run["dag_run_id"], "handle") or []:
                runs.setdefault(message_id, []).append(run["dag_run_id"])
    return runs


def _handled_all(airflow, ids: set[str]) -> dict[str, list[str]] | None:
    handled = _handled(airflow)
    return handled if ids <= set(handled) else None


def test_a_store_outage_while_events_are_acknowledged_starts_each_run_once(airflow, store, proxy):
    now = store.clock()
    messages = [DelayedMessage(DEST, b"{}", now + timedelta(seconds=5 + 10 * i), {}, f"out-{i}-{uuid.uuid4().hex[:6]}")
                for i in range(3)]
    store.store(messages)
    ids = {m.message_id for m in messages}
    log_start = airflow.log_size("triggerer")
    for m in messages:
        # Handed over (leased): its event is on its way to the metadata database, acknowledged about a state
        # sync later. Cut the triggerer's store connections now, and keep them refused for the outage (the next
        # message cannot be leased before it ends).
        wait_for(lambda m=m: _holder(store, m.message_id), 120, f"{m.message_id} to be handed over", poll=0.05)
        proxy.refuse_for(OUTAGE_SECONDS)
        proxy.cut()
    # Acknowledged (deleted) only once its event was recorded: when all are gone, every event that will ever be
    # recorded for them is; a message handed over twice would show as a second event.
    wait_for(lambda: all(_holder(store, i) == "gone" for i in ids), 240, "every message to be acknowledged")
    recorded = [e["extra"]["payload"]["message_id"] for e in airflow.asset_events(ASSET)
                if (e.get("extra") or {}).get("payload", {}).get("message_id") in ids]
    assert sorted(recorded) == sorted(ids), recorded  # one event per message: none lost, none handed over twice
    runs = wait_for(lambda: _handled_all(airflow, ids), 240, "a finished run per message")
    assert {i: len(runs[i]) for i in ids} == dict.fromkeys(ids, 1), runs
    assert store.count_scheduled(destination=DEST) == {}
    # The watcher lives on: its claim may have lapsed while the outages kept it from renewing, and is live again
    # at its next renewal.
    wait_for(lambda: store.event_claims(DEST), 60, "the watcher's claim to be renewed after the outages")
    # And the outages did meet acknowledgements, which were ridden out.
    airflow.wait_log("triggerer", rf"could not settle \d+ event\(s\) of {DEST}", timeout=5, since=log_start)

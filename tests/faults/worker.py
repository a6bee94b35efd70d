"""The processes the fault scenarios kill with SIGKILL and start again.

    python worker.py pump '<spec as JSON>'    a pump: store -> RabbitMQ or SQL table, until the store is empty
    python worker.py relay '<spec as JSON>'   an SQS relay on one endpoint, until killed

A pump prints its counts as one JSON line when the store is empty and exits 0; an error on a fault it
should survive ends it with a traceback and a non-zero code (the scenario reports that as a defect).
A relay prints `counts <relayed> <handed over> <failed>` after each receive it handled. While the file
`pause_file` exists it also prints `handled <n>` once its sends of a receive are done and before it
deletes the originals, and waits `pause` seconds there: the window the scenario kills it in (mid-cycle).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time


def pump(spec: dict) -> None:
    from airflow_delay_provider.core.pump import END_OF_TIME, Pump, PumpConfig
    from airflow_delay_provider.stores.sql import SqlDelayedMessageStore

    store = SqlDelayedMessageStore(spec["store_url"], table=spec["table"], schema=spec["schema"])
    if spec["transport"] == "rabbitmq":
        import pika

        from airflow_delay_provider.transports.rabbitmq import RabbitMQTransport

        params = pika.ConnectionParameters("127.0.0.1", spec["amqp_port"], spec["vhost"],
                                           pika.PlainCredentials("guest", "guest"), connection_attempts=1,
                                           blocked_connection_timeout=30)
        transport = RabbitMQTransport(params, prefix=spec["prefix"])
    else:
        from airflow_delay_provider.transports.sql import SqlTableTransport

        # The store's URL: one engine, so the pump inserts in its claim's transaction (exactly once).
        transport = SqlTableTransport(spec["store_url"], schema=spec["schema"], table_prefix=spec["prefix"])
    config = PumpConfig(batch_size=spec["batch_size"], progress_interval_seconds=3600)
    pump = Pump(store, transport, config)
    # due_before=END_OF_TIME: sleep until the next due time, stop only when nothing at all is stored.
    result = pump.run(due_before=END_OF_TIME)
    print(json.dumps({"reason": result.reason, "exactly_once": pump.exactly_once, "pipelined": pump.pipelined,
                      **result.stats.summary()}), flush=True)
    getattr(transport, "close", lambda: None)()
    store.close()


class _MarkingClient:
    """The boto3 SQS client, saying when a relay's sends are done and its delete is about to run."""

    def __init__(self, client, pause: float, pause_file: str) -> None:
        self._client = client
        self._pause = pause
        self._pause_file = pause_file

    def __getattr__(self, name):
        return getattr(self._client, name)

    def delete_message_batch(self, QueueUrl, Entries):  # noqa: N803 (boto3's argument names)
        marking = QueueUrl.endswith(".fifo") and os.path.exists(self._pause_file)
        if marking:
            print(f"handled {len(Entries)}", flush=True)
            time.sleep(self._pause)
        result = self._client.delete_message_batch(QueueUrl=QueueUrl, Entries=Entries)
        if marking:
            print("deleted", flush=True)
        return result


def relay(spec: dict) -> None:
    import boto3

    from airflow_delay_provider.transports.sqs import SqsTransport

    client = boto3.client("sqs", endpoint_url=spec["endpoint_url"], region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    transport = SqsTransport(_MarkingClient(client, spec["pause"], spec["pause_file"]), queue_delay=spec["queue_delay"])
    print("ready", flush=True)
    while True:
        counts = transport.relay_once(spec["endpoint"], wait_time_seconds=1,
                                      visibility_timeout=spec["visibility_timeout"])
        if counts.relayed or counts.handed_over or counts.failed:
            print(f"counts {counts.relayed} {counts.handed_over} {counts.failed}", flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    kind, raw = sys.argv[1:3]
    {"pump": pump, "relay": relay}[kind](json.loads(raw))

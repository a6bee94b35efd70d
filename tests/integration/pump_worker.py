"""A pump in its own process, for the concurrency and crash tests: prints its counts as JSON."""

import json
import logging
import sys

from airflow_delay_provider.core.pump import Pump, PumpConfig
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from airflow_delay_provider.transports.sql import SqlTableTransport

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    store_url, schema, table, transport_url, batch = sys.argv[1:6]
    schema = schema or None
    store = SqlDelayedMessageStore(store_url, table=table, schema=schema)
    transport = SqlTableTransport(transport_url, schema=schema if transport_url == store_url else None,
                                  table_prefix=f"{table}_")
    result = Pump(store, transport, PumpConfig(batch_size=int(batch))).run(stop_when_idle=True)
    print(json.dumps({"reason": result.reason, **result.stats.summary()}), flush=True)

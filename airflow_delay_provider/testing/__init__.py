"""In-memory store and transport: for tests of code built on this provider, and the fast test tier.

They keep the contracts of the real ones (the same contract tests run against both): claims hand a
message out once, settled messages leave the store, unsettled ones return to it, ids are de-duplicated,
a transport refuses destinations that were never provisioned. Thread-safe; nothing persists.

    store, transport = InMemoryStore(), InMemoryTransport()
    transport.provision("orders")
    store.store([DelayedMessage("orders", b"x", utcnow())])
    Pump(store, transport).run(stop_when_idle=True)
    [m] = transport.receive("orders")

A new transport for a broker follows InMemoryTransport's shape: check_endpoint, provision, send
(failures by id, never an exception for one bad message), receive/ack, depth, verify, from_spec; and
one line in `airflow_delay_provider.transports.registry`. InMemoryTransport also delays natively (a
message sent before its due time waits for it) and can take such messages back (take_held and the
rest), as the RabbitMQ transport does for a migration back to the store.
"""

from airflow_delay_provider.testing.store import InMemoryStore
from airflow_delay_provider.testing.transport import InMemoryTransport

__all__ = ["InMemoryStore", "InMemoryTransport"]

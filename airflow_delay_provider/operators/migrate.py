"""MigrateDelayedMessagesOperator: move pending messages between the store and RabbitMQ's delay levels."""

from __future__ import annotations

import json
from typing import Any

from airflow.sdk import Context

from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.core.migration import hand_over, take_back
from airflow_delay_provider.operators.base import DelayOperatorBase
from airflow_delay_provider.transports.registry import transport_class


class MigrateDelayedMessagesOperator(DelayOperatorBase):
    """Move pending delayed messages between the SQL store and RabbitMQ's delay levels, keeping due times.

    The transport must be RabbitMQ (`transport="rabbitmq"`, the default here), reached through the
    `rabbitmq` connection `transport_conn_id` (default `rabbitmq_default`). Returns the counts.

    :param direction: required. `"store_to_rabbitmq"` hands every stored message (due or not) to the
        levels with its remaining delay (messages the broker refuses stay stored);
        `"rabbitmq_to_store"` drains the levels into the store (messages without the needed headers go
        to the `<prefix>.poison` queue).
    :param batch_size: messages moved at a time (default 500): claimed from the store per transaction, or
        read from a level and acknowledged once the store has committed them.
    """

    DIRECTIONS = ("store_to_rabbitmq", "rabbitmq_to_store")

    def __init__(self, *, direction: str, batch_size: int = 500, **kwargs: Any) -> None:
        kwargs.setdefault("transport", "rabbitmq")
        super().__init__(**kwargs)
        if direction not in self.DIRECTIONS:
            raise InvalidInputError(f"direction {direction!r} is not supported; choose one of {list(self.DIRECTIONS)}")
        taker = transport_class(self.transport)
        if not (taker.delays_natively and taker.can_take_back):
            raise InvalidInputError(
                f"migration moves messages between the store and a broker that holds them until due and can hand "
                f"them back (transport='rabbitmq'); transport={self.transport!r} cannot")
        self.direction = direction
        self.batch_size = batch_size

    def execute(self, context: Context) -> dict:
        store = self.hook.get_store()
        self.hook.prepare_for_writes(store)  # created or upgraded only where auto_migrate allows it
        transport = self.get_transport()
        try:
            if self.direction == "store_to_rabbitmq":
                result = hand_over(store, transport, self.batch_size)
            else:
                result = take_back(store, transport, self.batch_size)
        finally:
            transport.close()
        self.log.info("Migrated (%s): %s", self.direction, json.dumps(result))
        return {"direction": self.direction, **result}

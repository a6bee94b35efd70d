"""The delay infrastructure as data: the TTL levels, the delivery exchange, the safety-net queues
and each endpoint's queue and binding.

Level n is a topic exchange that routes a message whose bit n is 1 into a quorum queue with a TTL
of 2^n s, and one whose bit n is 0 straight on to level n-1; an expired message is dead-lettered
(at least once) to level n-1 as well. Level 0 ends in the delivery exchange, where every endpoint
queue is bound on exactly `levels` one-word bits and its own name (`*.*. … .*.<endpoint>`), so
`cancel` does not also catch `orders.cancel`. The delivery exchange has an alternate exchange: a
message for a destination with no binding lands in the `unroutable` queue instead of being dropped.
Endpoint queues dead-letter a message redelivered more than `delivery_limit` times to the `poison`
queue. Pure: what to declare, not declaring it.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from airflow_delay_provider.core.checks import check_int
from airflow_delay_provider.core.errors import InvalidInputError, InvalidNameError
from airflow_delay_provider.transports.rabbitmq.routing import LEVELS, check_endpoint

#: Redeliveries an endpoint queue allows before a message goes to poison: RabbitMQ 4.x's own default
#: (3.x has no limit), set explicitly so every broker version behaves alike and nothing is dropped.
DELIVERY_LIMIT = 20


@dataclass(frozen=True)
class Exchange:
    name: str
    type: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Queue:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    #: Arguments an earlier version declared this queue with: such a queue is kept (arguments
    #: cannot change in place) and reported as outdated instead of failing the declaration.
    legacy_arguments: dict[str, Any] | None = None


@dataclass(frozen=True)
class Binding:
    source: str
    destination: str
    destination_type: str  # "queue" or "exchange"
    routing_key: str


@dataclass(frozen=True)
class Topology:
    exchanges: tuple[Exchange, ...]
    queues: tuple[Queue, ...]
    bindings: tuple[Binding, ...]
    #: Bindings of earlier versions, removed once `bindings` are in place.
    retired: tuple[Binding, ...] = ()


QUORUM = {"x-queue-type": "quorum"}


class Names:
    """Every name of the delay infrastructure under one prefix."""

    def __init__(self, prefix: str = "delay", levels: int = LEVELS) -> None:
        check_int("levels", levels, 1, LEVELS, error=InvalidNameError)
        try:
            check_endpoint(f"{prefix}.level-00")
        except InvalidInputError as exc:
            raise InvalidNameError(f"prefix {prefix!r} cannot name the delay exchanges and queues: {exc}") from None
        self.prefix = prefix
        self.levels = levels
        self.delivery = f"{prefix}.delivery"
        self.unroutable = f"{prefix}.unroutable"
        self.poison = f"{prefix}.poison"

    def level(self, n: int) -> str:
        return f"{self.prefix}.level-{n:02d}"


def delay_topology(names: Names) -> Topology:
    """The TTL levels and their bindings, the delivery exchange, the unroutable safety net and poison.

    Level queues get no delivery limit: their dead-letter exchange is the next level (for TTL
    expiry), so a message redelivered past a limit would move on early instead of reaching poison.
    """
    exchanges, queues, bindings = [], [], []
    top = names.levels - 1
    for n in range(top, -1, -1):
        level = names.level(n)
        onward = names.level(n - 1) if n else names.delivery
        exchanges.append(Exchange(level, "topic"))
        queues.append(
            Queue(
                level,
                {
                    **QUORUM,
                    "x-message-ttl": 2**n * 1000,
                    "x-dead-letter-exchange": onward,
                    "x-dead-letter-strategy": "at-least-once",
                    "x-overflow": "reject-publish",
                },
            )
        )
        skip = "*." * (top - n)
        bindings.append(Binding(level, level, "queue", skip + "1.#"))
        bindings.append(Binding(level, onward, "exchange", skip + "0.#"))
    exchanges.append(Exchange(names.delivery, "topic", {"alternate-exchange": names.unroutable}))
    exchanges.append(Exchange(names.unroutable, "fanout"))
    queues.append(Queue(names.unroutable, dict(QUORUM)))
    queues.append(Queue(names.poison, dict(QUORUM)))
    bindings.append(Binding(names.unroutable, names.unroutable, "queue", ""))
    return Topology(tuple(exchanges), tuple(queues), tuple(bindings))


def endpoint_binding_key(names: Names, endpoint: str) -> str:
    """Exactly `levels` one-word bits and the endpoint: `cancel` does not match `<bits>.orders.cancel`."""
    return "*." * names.levels + endpoint


def endpoint_arguments(names: Names, delivery_limit: int) -> dict[str, Any]:
    """A quorum queue that dead-letters a message redelivered more than `delivery_limit` times to
    poison, at least once (which needs reject-publish), through the default exchange."""
    return {
        **QUORUM,
        "x-delivery-limit": delivery_limit,
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": names.poison,
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
    }


def endpoint_topology(names: Names, endpoint: str, delivery_limit: int = DELIVERY_LIMIT) -> Topology:
    check_endpoint(endpoint, names.levels)
    return Topology(
        (),
        (Queue(endpoint, endpoint_arguments(names, delivery_limit), legacy_arguments=dict(QUORUM)),),
        (Binding(names.delivery, endpoint, "queue", endpoint_binding_key(names, endpoint)),),
        # `#.<endpoint>` also matched `<bits>.orders.<endpoint>`; every key in flight has exactly
        # `levels` bits, so the exact binding, added first, takes all of them over.
        retired=(Binding(names.delivery, endpoint, "queue", f"#.{endpoint}"),),
    )


def delivery_limit_policy(names: Names, vhost: str, queues: Sequence[str], delivery_limit: int) -> str:
    """The rabbitmqctl command giving outdated endpoint queues what their arguments lack."""
    pattern = "^(" + "|".join(re.escape(q) for q in queues) + ")$"
    definition = {
        "delivery-limit": delivery_limit,
        "dead-letter-exchange": "",
        "dead-letter-routing-key": names.poison,
        "dead-letter-strategy": "at-least-once",
        "overflow": "reject-publish",
    }
    return shlex.join(["rabbitmqctl", "set_policy", "-p", vhost, f"{names.prefix}.delivery-limit", pattern,
                       json.dumps(definition), "--apply-to", "queues"])

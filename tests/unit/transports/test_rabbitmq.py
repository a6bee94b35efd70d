"""Routing keys and names of the RabbitMQ delay levels (no broker needed)."""

import pytest

from airflow_delay_provider.core.errors import DelayError, InvalidNameError
from airflow_delay_provider.transports.rabbitmq.routing import (
    MAX_DELAY_SECONDS,
    check_endpoint,
    first_level,
    routing_key,
)
from airflow_delay_provider.transports.rabbitmq.topology import Names, delay_topology


def bits(key: str, levels: int = 28) -> str:
    return "".join(key.split(".")[:levels])


def test_documented_example_with_four_levels():
    assert routing_key(5, "destination", levels=4) == "0.1.0.1.destination"


@pytest.mark.parametrize(
    ("delay", "level"),
    [(0, 0), (1, 0), (2, 1), (5, 2), (10, 3), (15, 3), (28, 4), (MAX_DELAY_SECONDS - 1, 27), (MAX_DELAY_SECONDS, 27)],
)
def test_routing_key_bits_and_entry_level(delay, level):
    key = routing_key(delay, "orders")
    assert key.endswith(".orders")
    assert int(bits(key), 2) == delay and len(key.split(".")) == 29
    assert first_level(delay) == level


def test_max_and_beyond():
    assert MAX_DELAY_SECONDS == 268_435_455
    assert bits(routing_key(MAX_DELAY_SECONDS, "q")) == "1" * 28
    with pytest.raises(DelayError, match="exceeds the maximum delay value of 268435455 s"):
        routing_key(MAX_DELAY_SECONDS + 1, "q")
    with pytest.raises(DelayError, match="maximum delay value of 15 s"):
        routing_key(16, "q", levels=4)


def test_negative_fraction_empty_and_unicode():
    assert bits(routing_key(-123, "q")) == "0" * 28
    assert bits(routing_key(1.2, "q")) == "0" * 26 + "10"  # rounded up to 2
    assert routing_key(3, "") == ".".join("0" * 26 + "11") + "."
    assert routing_key(3, "zamówienia.ünï.配送").endswith(".1.1.zamówienia.ünï.配送")
    with pytest.raises(DelayError):
        routing_key(True, "q")


@pytest.mark.parametrize("bad", ["a*b", "a.#", "a..b", ".a", "a.", "", "x" * 200])
def test_endpoint_names_safe_as_routing_key_words(bad):
    with pytest.raises((InvalidNameError, ValueError)):
        check_endpoint(bad)


def test_topology_shape():
    t = delay_topology(Names("delay"))
    assert [e.name for e in t.exchanges][:2] == ["delay.level-27", "delay.level-26"]
    assert len(t.exchanges) == 28 + 2 and len(t.queues) == 28 + 2
    level0 = next(q for q in t.queues if q.name == "delay.level-00")
    assert level0.arguments["x-dead-letter-exchange"] == "delay.delivery"
    assert next(q for q in t.queues if q.name == "delay.level-27").arguments["x-message-ttl"] == 2**27 * 1000

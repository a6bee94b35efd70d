"""The routing key that carries a message's delay through the levels, and the names it can carry.

A delay of d seconds is written as `levels` bits, most significant first, followed by the destination:
`0.0.....1.0.1.orders`. Pure rules: no broker, no pika.
"""

from __future__ import annotations

from airflow_delay_provider.core.delays import whole_seconds
from airflow_delay_provider.core.errors import DelayError, InvalidNameError
from airflow_delay_provider.core.message import check_destination

LEVELS = 28
MAX_DELAY_SECONDS = 2**LEVELS - 1  # 268,435,455 s, about 8.5 years
#: Routing keys are at most 255 bytes; the delay bits take 2 bytes per level.
MAX_ROUTING_KEY_BYTES = 255


def max_delay(levels: int = LEVELS) -> int:
    largest: int = 2**levels - 1  # int ** int is Any to mypy (a negative power is a float)
    return largest


def routing_key(delay_seconds: int | float, destination: str, levels: int = LEVELS) -> str:
    """`b(levels-1). … .b0.destination`: the delay in binary, most significant bit first.

    Fractions round up, negative delays mean 0; a delay above 2^levels - 1 raises DelayError.
    """
    delay = whole_seconds(delay_seconds, negative_is_now=True)
    check_levels(delay, levels)
    return ".".join(format(delay, f"0{levels}b")) + "." + destination


def check_levels(delay: int, levels: int = LEVELS) -> None:
    """Raise DelayError when `levels` cannot carry `delay` seconds, naming the level count that would."""
    if delay > max_delay(levels):
        needed = delay.bit_length()
        fix = (f"{needed} levels would carry it (the connection's `levels` extra, at most {LEVELS})"
               if needed <= LEVELS else f"no RabbitMQ topology carries more than {max_delay(LEVELS)} s ({LEVELS} "
               "levels): keep the message in the store (transport='sql')")
        raise DelayError(
            f"cannot delay a message by {delay} s: it exceeds the maximum delay value of {max_delay(levels)} s "
            f"({levels} levels, about {max_delay(levels) / 31_557_600:.1f} years); {fix}"
        )


def first_level(delay_seconds: int) -> int:
    """The level a delayed message enters at: its highest set bit (0 when there is none)."""
    return max(0, int(delay_seconds).bit_length() - 1)


def naming_rule(levels: int = LEVELS) -> str:
    return (
        "a RabbitMQ destination is one or more words separated by single dots, since it travels as the tail of "
        "a topic routing key; a word is any characters (Unicode too) but no '*' or '#' (topic wildcards), and none "
        "is empty (no leading, trailing or doubled dot); names starting with 'amq.' are reserved by RabbitMQ; "
        f"at most {MAX_ROUTING_KEY_BYTES - 2 * levels} bytes in UTF-8 with {levels} delay levels"
    )


def check_endpoint(name: object, levels: int = LEVELS) -> str:
    """An endpoint (queue) name that is safe as the tail of a topic routing key."""
    name = check_destination(name)
    size = len(name.encode())
    if "" in name.split("."):
        problem = "it has an empty word"
    elif "*" in name or "#" in name:
        problem = "it contains a topic wildcard ('*' or '#')"
    elif name.startswith("amq."):
        problem = "the 'amq.' prefix is reserved"
    elif size > MAX_ROUTING_KEY_BYTES - 2 * levels:
        problem = f"it takes {size} bytes"
    else:
        return name
    raise InvalidNameError(f"RabbitMQ destination {name!r} cannot be routed, {problem}: {naming_rule(levels)}")


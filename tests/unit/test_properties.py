"""Property-based tests (hypothesis) of the pure rules: delays, routing keys, SQS plans, policies, throttles.

Each property is one the code promises in its docstrings or the docs; an example that once broken
it is kept as an `@example`.
"""

from __future__ import annotations

import json
import math
import random
import re
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from airflow_delay_provider.core.delays import MAX_DELAY_SECONDS, resolve_delay, seconds_until, to_seconds
from airflow_delay_provider.core.errors import DelayError, InvalidMessageError, InvalidNameError
from airflow_delay_provider.core.message import (
    HEADER_FAILED_AT,
    HEADER_FAILED_DESTINATION,
    HEADER_FAILURE_REASON,
    HEADER_FAILURES,
    HEADER_FIRST_FAILED_AT,
    MAX_DESTINATION_LENGTH,
    DelayedMessage,
    check_destination,
    stable_message_id,
)
from airflow_delay_provider.core.requests import build_message
from airflow_delay_provider.core.retry_policy import (
    BACKOFF_FUNCTIONS,
    MAX_DELAY_TARGET,
    MAX_RETRIES,
    DeliveryPolicy,
    PolicyError,
    backoff,
)
from airflow_delay_provider.core.throttle import TokenBucket
from airflow_delay_provider.transports import rabbitmq as rmq
from airflow_delay_provider.transports import sqs
from airflow_delay_provider.transports.sqs import bodies as sqs_bodies
from airflow_delay_provider.transports.sqs import naming as sqs_naming
from airflow_delay_provider.transports.sqs import transport as sqs_transport

# No example database: nothing written into the working tree; examples worth keeping are `@example`s.
FAST = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
MORE = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
NOW = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)

# -- strategies ------------------------------------------------------------------------------------
FIELDS = st.sampled_from(["delay_seconds", "messages[3].delay_seconds", "deliver_at (seconds from now)",
                          "queue_delay_seconds", "endpoint_options.queue_delay_seconds"])
NOT_AN_INT = st.one_of(st.floats(allow_nan=True), st.text(max_size=5), st.booleans(),
                       st.lists(st.integers(), max_size=2), st.timedeltas())
ANYTHING = st.one_of(st.integers(), st.floats(), st.text(max_size=8), st.booleans(), st.none(), st.timedeltas(),
                     st.lists(st.integers(), max_size=2),
                     st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))
ZONES = st.integers(-14 * 60, 14 * 60).map(lambda minutes: timezone(timedelta(minutes=minutes)))


@st.composite
def policies(draw) -> DeliveryPolicy:
    high = draw(st.integers(0, MAX_DELAY_TARGET))
    low = draw(st.integers(0, high))
    n = draw(st.integers(0, MAX_RETRIES))
    immediate = draw(st.integers(0, n))
    pre = draw(st.integers(0, n - immediate))
    post = draw(st.integers(0, n - immediate - pre))
    return DeliveryPolicy(low, high, n, immediate, pre, post, draw(st.sampled_from(BACKOFF_FUNCTIONS)),
                          draw(st.none() | st.integers(1, 10_000)))


# A RabbitMQ endpoint: dot-separated words, any characters but the topic wildcards and dots.
WORD = st.text(st.characters(exclude_characters=".*#\x00\r\n", exclude_categories=("Cs",)), min_size=1, max_size=8)
ENDPOINTS = st.lists(WORD, min_size=1, max_size=3).map(".".join).filter(
    lambda name: name.strip() != "" and not name.startswith("amq."))
SQS_NAMES = st.from_regex(r"[A-Za-z0-9_-]{1,40}", fullmatch=True)


# -- delays --------------------------------------------------------------------------------------
@MORE
@given(value=st.integers(-(10**7), 10**7) | NOT_AN_INT | st.none(), field=FIELDS)
@example(value=MAX_DELAY_SECONDS + 1, field="delay_seconds")
@example(value=True, field="queue_delay_seconds")
def test_delay_validation_accepts_exactly_0_to_max_and_names_the_argument_set(value, field):
    valid = value is None or (type(value) is int and 0 <= value <= MAX_DELAY_SECONDS)
    for kwargs in ({"message_delay": value, "message_field": field}, {"queue_delay": value, "queue_field": field}):
        if valid:
            assert resolve_delay(**kwargs) == (value or 0)
            continue
        with pytest.raises(DelayError) as err:
            resolve_delay(**kwargs)
        assert isinstance(err.value, ValueError)
        text = str(err.value)
        assert text.startswith(field) and f"0..{MAX_DELAY_SECONDS}" in text
        assert "message_delay" not in text.replace(field, "") and "queue_delay " not in text


@MORE
@given(message=st.none() | st.integers(0, MAX_DELAY_SECONDS), queue=st.none() | st.integers(0, MAX_DELAY_SECONDS))
def test_a_message_level_delay_over_0_wins_else_the_queue_level_one(message, queue):
    assert resolve_delay(message, queue) == (message if message else queue or 0)


@MORE
@given(delay=st.integers(0, 10**12) | st.floats(0, 10**9) | st.timedeltas(timedelta(0), timedelta(days=3650)))
def test_to_seconds_rounds_up_never_early_by_less_than_a_second(delay):
    seconds = to_seconds(delay)
    exact = delay.total_seconds() if isinstance(delay, timedelta) else delay
    assert type(seconds) is int and exact <= seconds and seconds - 1 < exact
    if not isinstance(delay, timedelta):
        assert to_seconds(repr(float(delay))) == math.ceil(float(delay))  # a rendered template


@MORE
@given(value=ANYTHING, field=FIELDS)
@example(value=10**400, field="delay_seconds")  # math.isnan(10**400) raised OverflowError, not DelayError
@example(value=float("inf"), field="delay_seconds")
@example(value="1e400", field="delay_seconds")
def test_to_seconds_returns_whole_seconds_or_a_delay_error_naming_the_field(value, field):
    try:
        seconds = to_seconds(value, field)
    except DelayError as exc:
        assert str(exc).startswith(field)
        return
    assert type(seconds) is int and seconds >= 0


@MORE
@given(offset=st.timedeltas(timedelta(days=-3650), timedelta(days=3650)), zone=ZONES)
def test_seconds_until_is_never_early_and_past_means_now(offset, zone):
    deliver_at = (NOW + offset).astimezone(zone)
    seconds = seconds_until(deliver_at, NOW)
    due = NOW + timedelta(seconds=seconds)
    assert due >= deliver_at and due >= NOW
    assert due - max(deliver_at, NOW) < timedelta(seconds=1)
    with pytest.raises(DelayError, match="deliver_at must be timezone-aware"):
        seconds_until(deliver_at.replace(tzinfo=None), NOW)


@MORE
@given(delay=st.floats(0, 2 * MAX_DELAY_SECONDS) | st.integers(-5, 2 * MAX_DELAY_SECONDS),
       queue=st.none() | st.integers(0, MAX_DELAY_SECONDS))
def test_build_message_due_time_is_the_delay_rounded_up_or_an_error_naming_delay_seconds(delay, queue):
    item = {"destination": "q", "delay_seconds": delay}
    if delay < 0 or math.ceil(delay) > MAX_DELAY_SECONDS:
        with pytest.raises(DelayError, match=r"^delay_seconds must be (in 0\.\.604800|>= 0 seconds)"):
            build_message(item, NOW, queue)
        return
    due = build_message(item, NOW, queue).due_at
    expected = math.ceil(delay) or queue or 0
    assert due == NOW + timedelta(seconds=expected) and due >= NOW + timedelta(seconds=delay)


@MORE
@given(offset=st.timedeltas(timedelta(days=-30), timedelta(days=30)), zone=ZONES)
def test_build_message_deliver_at_is_never_early_or_an_error_naming_deliver_at(offset, zone):
    deliver_at = (NOW + offset).astimezone(zone)
    for given_as in (deliver_at, deliver_at.isoformat()):
        if offset > timedelta(seconds=MAX_DELAY_SECONDS):
            with pytest.raises(DelayError,
                               match=r"^messages\[1\]\.deliver_at \(seconds from now\) must be in 0\.\.604800"):
                build_message({"destination": "q", "deliver_at": given_as}, NOW, where="messages[1].")
            continue
        m = build_message({"destination": "q", "deliver_at": given_as}, NOW)
        assert m.due_at >= deliver_at and m.due_at >= NOW and m.due_at - max(deliver_at, NOW) < timedelta(seconds=1)
        assert m.due_at.utcoffset() == timedelta(0)


# -- messages ------------------------------------------------------------------------------------
@MORE
@given(name=st.text(max_size=300) | st.integers() | st.none())
@example(name=" \t ")
@example(name="x" * MAX_DESTINATION_LENGTH)
def test_check_destination_accepts_exactly_the_documented_names(name):
    ok = (isinstance(name, str) and name.strip() != "" and len(name) <= MAX_DESTINATION_LENGTH
          and not any(c in name for c in "\x00\r\n"))
    if ok:
        assert check_destination(name) == name
    else:
        with pytest.raises(InvalidMessageError, match="^destination must be"):
            check_destination(name)


HEADERS = st.dictionaries(st.text(min_size=1, max_size=10).filter(lambda k: not k.startswith("x-delay-")),
                          st.text(max_size=20), max_size=5)


@FAST
@given(body=st.binary(max_size=64) | st.text(max_size=32), headers=HEADERS, zone=ZONES,
       offset=st.timedeltas(timedelta(days=-1), timedelta(days=8)), reason=st.text(max_size=1500),
       failures=st.integers(0, 100))
def test_messages_keep_id_body_and_instant_and_dead_lettering_says_where_and_why(body, headers, zone, offset, reason,
                                                                                 failures):
    due = (NOW + offset).astimezone(zone)
    m = DelayedMessage("orders", body, due, headers, "id-1", failures)
    assert m.body == (body.encode() if isinstance(body, str) else body)
    assert m.due_at == due and m.due_at.utcoffset() == timedelta(0)
    first = m.dead_lettered("error", reason, NOW)
    again = first.dead_lettered("error2", "later", NOW + timedelta(hours=1))
    for d in (first, again):
        assert (d.message_id, d.body, d.due_at, d.failures) == (m.message_id, m.body, m.due_at, m.failures)
        assert d.headers[HEADER_FIRST_FAILED_AT] == NOW.isoformat()  # the first failure is kept
        assert {k: v for k, v in d.headers.items() if k not in headers} .keys() <= {
            HEADER_FIRST_FAILED_AT, HEADER_FAILED_AT, HEADER_FAILED_DESTINATION, HEADER_FAILURE_REASON, HEADER_FAILURES}
    assert first.headers[HEADER_FAILED_DESTINATION] == "orders" and first.destination == "error"
    assert first.headers[HEADER_FAILURE_REASON] == reason[:1000]
    assert again.headers[HEADER_FAILED_DESTINATION] == "error"
    assert {k: first.headers[k] for k in headers} == headers


@FAST
@given(parts=st.lists(st.text(max_size=20) | st.integers(), max_size=5))
def test_stable_message_ids_are_deterministic_and_valid_ids(parts):
    mid = stable_message_id(*parts)
    assert mid == stable_message_id(*parts) and len(mid) == 36
    assert DelayedMessage("q", b"", NOW, message_id=mid).message_id == mid


# -- RabbitMQ: the 28-level binary TTL topology ------------------------------------------------------
def topic_match(pattern: str, key: str) -> bool:
    """AMQP topic matching: '*' is exactly one word, '#' zero or more."""
    p, k = pattern.split("."), key.split(".")

    def match(i: int, j: int) -> bool:
        if i == len(p):
            return j == len(k)
        if p[i] == "#":
            return any(match(i + 1, jj) for jj in range(j, len(k) + 1))
        return j < len(k) and p[i] in ("*", k[j]) and match(i + 1, j + 1)

    return match(0, 0)


@st.composite
def levels_and_delay(draw):
    levels = draw(st.integers(1, rmq.LEVELS))
    return levels, draw(st.integers(0, rmq.max_delay(levels)))


@MORE
@given(case=levels_and_delay(), endpoint=ENDPOINTS)
@example(case=(28, rmq.MAX_DELAY_SECONDS), endpoint="orders")
@example(case=(28, 0), endpoint="a.b")
def test_the_routing_key_spells_the_delay_in_binary_over_the_levels(case, endpoint):
    levels, delay = case
    key = rmq.routing_key(delay, endpoint, levels)
    words = key.split(".", levels)
    assert len(words) == levels + 1 and words[-1] == endpoint
    bits = words[:levels]
    assert set(bits) <= {"0", "1"}
    # word i is level (levels - 1 - i), whose queue's TTL is 2^level s: the TTLs of the 1-bits sum to the delay
    assert sum(2 ** (levels - 1 - i) for i, b in enumerate(bits) if b == "1") == delay
    assert rmq.first_level(delay) == (max(i for i in range(levels) if bits[levels - 1 - i] == "1") if delay else 0)
    if delay:
        assert rmq.routing_key(delay - 0.5, endpoint, levels) == key  # fractions round up


@FAST
@given(case=levels_and_delay(), endpoint=ENDPOINTS, other=ENDPOINTS)
@example(case=(4, 5), endpoint="orders.cancel", other="cancel")
@example(case=(3, 7), endpoint="cancel", other="orders.cancel")
def test_a_message_walks_the_levels_for_exactly_its_delay_and_reaches_only_its_endpoint(case, endpoint, other):
    """Route the key through the declared topology as RabbitMQ's topic exchanges would."""
    levels, delay = case
    names = rmq.Names("delay", levels)
    topology = rmq.delay_topology(names)
    queues = {q.name: q for q in topology.queues}
    key = rmq.routing_key(delay, endpoint, levels)
    exchange, waited, visited = names.level(rmq.first_level(delay)), 0, []
    while exchange != names.delivery:
        routes = [b for b in topology.bindings if b.source == exchange and topic_match(b.routing_key, key)]
        assert len(routes) == 1, (exchange, key, routes)  # never dropped, never duplicated
        route = routes[0]
        if route.destination_type == "queue":
            queue = queues[route.destination]
            assert queue.name not in visited
            visited.append(queue.name)
            waited += queue.arguments["x-message-ttl"] // 1000
            exchange = queue.arguments["x-dead-letter-exchange"]  # on expiry
        else:
            exchange = route.destination
    assert waited == delay
    assert topic_match(rmq.endpoint_binding_key(names, endpoint), key)
    assume(other != endpoint)
    assert not topic_match(rmq.endpoint_binding_key(names, other), key)


@MORE
@given(delay=st.integers() | st.floats(allow_nan=False), levels=st.integers(1, rmq.LEVELS))
@example(delay=float("inf"), levels=28)  # math.ceil(inf) raised OverflowError, not DelayError
@example(delay=float("-inf"), levels=28)
@example(delay=10**400, levels=28)
def test_every_delay_in_range_has_one_key_and_any_other_is_refused_with_the_maximum(delay, levels):
    top = rmq.max_delay(levels)
    if isinstance(delay, float) and math.isinf(delay) or delay > top:
        with pytest.raises(DelayError, match=f"maximum delay value of {top} s|finite"):
            rmq.routing_key(delay, "q", levels)
        return
    key = rmq.routing_key(delay, "q", levels)
    assert int("".join(key.split(".")[:levels]), 2) == max(0, math.ceil(delay))


@FAST
@given(value=ANYTHING)
def test_routing_key_refuses_what_is_not_a_number_with_a_delay_error(value):
    assume(not (isinstance(value, (int, float)) and not isinstance(value, bool)))
    with pytest.raises(DelayError, match="delay_seconds must be a"):
        rmq.routing_key(value, "q")


@MORE
@given(name=st.text(max_size=240) | ENDPOINTS, levels=st.integers(1, rmq.LEVELS))
@example(name="x" * (255 - 56), levels=28)
@example(name="x" * (255 - 55), levels=28)
def test_every_accepted_endpoint_fits_a_routing_key_and_every_refusal_says_why(name, levels):
    try:
        rmq.check_endpoint(name, levels)
    except InvalidNameError as exc:
        assert "cannot be routed" in str(exc) and "no '*' or '#'" in str(exc)
        return
    except InvalidMessageError as exc:
        assert str(exc).startswith("destination must be")
        return
    key = rmq.routing_key(rmq.max_delay(levels), name, levels)
    assert len(key.encode()) <= rmq.MAX_ROUTING_KEY_BYTES
    assert "" not in name.split(".") and not set(name) & {"*", "#"}


@FAST
@given(levels=st.integers(-3, 40) | st.booleans() | st.floats(0, 30) | st.text(max_size=2))
@example(levels=True)
def test_names_accept_levels_1_to_28_only(levels):
    if type(levels) is int and 1 <= levels <= rmq.LEVELS:
        assert rmq.Names("p", levels).levels == levels
    else:
        with pytest.raises(InvalidNameError, match="levels must be an int in 1..28"):
            rmq.Names("p", levels)


# -- SQS: native delays and the -delay.fifo relay -----------------------------------------------------
@MORE
@given(delay=st.integers(0, 10**9) | st.floats(0, 10**9), q=st.integers(1, sqs.NATIVE_MAX_DELAY))
@example(delay=1800, q=900)
@example(delay=901, q=900)
@example(delay=900.5, q=900)
def test_plan_hops_are_each_at_most_900_s_and_add_up_to_the_delay(delay, q):
    plan = sqs.delay_plan(delay, q)
    whole = math.ceil(delay)
    # every hop but the last is one pass through the delay queue (Q s), the last the destination's DelaySeconds
    assert plan.delay == whole >= delay and plan.fifo_cycles * q + plan.final_delay == whole  # never early
    assert 0 <= plan.final_delay <= q <= sqs.NATIVE_MAX_DELAY
    assert plan.native == (whole <= q) == (plan.fifo_cycles == 0)
    if not plan.native:
        assert plan.final_delay > 0  # no empty last hop: the fewest cycles that fit
    assert plan.fifo_cycles == max(0, -(-whole // q) - 1)
    assert plan.requests() == 2 * plan.fifo_cycles
    assert sqs.estimate_cost(delay, 0.5, q) == plan.requests() * 0.5


@FAST
@given(delay=st.integers(-(10**6), -1) | st.sampled_from([float("inf"), float("-inf"), float("nan")]) | NOT_AN_INT,
       q=st.integers(-5, 2000) | st.booleans())
@example(delay=float("inf"), q=900)  # math.ceil(inf) raised OverflowError, not DelayError
def test_plans_refuse_negative_infinite_or_non_numbers_and_queue_delays_outside_1_to_900(delay, q):
    assume(not (isinstance(delay, float) and 0 <= delay < float("inf")))
    with pytest.raises(DelayError, match="delay_seconds must be|queue_delay must be an int in 1..900"):
        sqs.delay_plan(delay, q)
    if not (type(q) is int and 1 <= q <= 900):
        with pytest.raises(DelayError, match=r"queue_delay must be an int in 1\.\.900 seconds \(SQS's limit\)"):
            sqs.delay_plan(10, q)


@MORE
@given(name=st.text(max_size=90), prefix=st.text(max_size=12))
def test_delay_queue_names_are_valid_sqs_fifo_names_or_refused_saying_how_long(name, prefix):
    full = len(prefix) + len(name) + len(sqs.DELAY_QUEUE_SUFFIX)
    if full > sqs.MAX_QUEUE_NAME:
        with pytest.raises(InvalidNameError) as err:
            sqs.delay_queue_name(name, prefix)
        allowed = sqs.MAX_QUEUE_NAME - len(prefix) - len(sqs.DELAY_QUEUE_SUFFIX)
        assert f"at most {allowed} characters" in str(err.value)
        return
    result = sqs.delay_queue_name(name, prefix)
    assert sqs.check_queue_name(result) == result and result.endswith(sqs.DELAY_QUEUE_SUFFIX) and len(result) == full


@MORE
@given(a=SQS_NAMES, b=SQS_NAMES, prefix=st.from_regex(r"[a-z-]{0,5}", fullmatch=True))
def test_distinct_endpoints_get_distinct_delay_queues(a, b, prefix):
    """Within the documented name set [A-Za-z0-9_-]: a shared delay queue would hand one endpoint's
    messages to the other's relay. (Names ending in .fifo are outside it: `x.fifo` and `x-fifo` collide.)"""
    assume(a != b)
    assert sqs.delay_queue_name(a, prefix) != sqs.delay_queue_name(b, prefix)


@MORE
@given(name=st.text(max_size=90))
@example(name=".fifo")  # was accepted: a FIFO queue needs a name before its suffix
@example(name="x" * 75 + ".fifo")
def test_check_queue_name_accepts_exactly_sqs_names(name):
    ok = re.fullmatch(r"[A-Za-z0-9_-]{1,80}|[A-Za-z0-9_-]{1,75}\.fifo", name) is not None
    if ok:
        assert sqs.check_queue_name(name) == name
    else:
        with pytest.raises(InvalidNameError, match="1-80 characters of A-Z, a-z, 0-9, '-' and '_'"):
            sqs.check_queue_name(name)


# What SendMessage accepts in a body (W3C XML characters); anything else SQS refuses or replaces with U+FFFD.
SQS_TEXT = re.compile("[\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]*")


@MORE
@given(body=st.binary(max_size=300) | st.text(max_size=100).map(str.encode))
@example(body=b"\x00\x01 valid UTF-8, not valid in SQS")
@example(body="\ufffe".encode())
@example(body=b"\xff\xfe")
def test_sqs_bodies_round_trip_and_carry_only_characters_sqs_keeps(body):
    attributes: dict = {}
    encoded = sqs_bodies._encode_body(body, attributes)
    assert SQS_TEXT.fullmatch(encoded), encoded  # else SQS refuses it or corrupts it silently
    assert sqs_bodies._decode_body({"Body": encoded, "MessageAttributes": attributes}) == body
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return
    if SQS_TEXT.fullmatch(text):
        assert encoded == text and not attributes  # readable text stays readable


@FAST
@given(value=st.text(max_size=200), cycle=st.integers(0, 10**6), other=st.integers(0, 10**6))
def test_fifo_ids_are_always_valid_and_each_cycle_has_its_own(value, cycle, other):
    fifo_id = sqs_naming._fifo_id(value)
    assert sqs_naming._FIFO_ID.fullmatch(fifo_id)
    if sqs_naming._FIFO_ID.fullmatch(value):
        assert fifo_id == value
    assume(cycle != other)
    assert sqs_naming._dedup_id(value, cycle) != sqs_naming._dedup_id(value, other)


@FAST
@given(sizes=st.lists(st.integers(0, 300_000), max_size=30))
def test_batches_hold_at_most_10_entries_and_1_mib_and_lose_nothing(sizes):
    entries = [{"MessageBody": "x" * size,
                "MessageAttributes": {"x-message-id": {"DataType": "String", "StringValue": f"m-{i}"}}}
               for i, size in enumerate(sizes)]
    chunks = list(sqs_transport._chunks(entries))
    assert [i for chunk in chunks for i in chunk] == list(range(len(entries)))  # each once, in order
    for chunk in chunks:
        assert 1 <= len(chunk) <= sqs.BATCH_SIZE
        # What SQS counts: bodies and attributes (name, type and value).
        counted = sum(len(entries[i]["MessageBody"]) + len("x-message-id") + len("String") + len(f"m-{i}")
                      for i in chunk)
        assert len(chunk) == 1 or counted <= sqs.MAX_BATCH_BYTES


# -- delivery policies -------------------------------------------------------------------------------
@MORE
@given(policy=policies())
def test_policies_round_trip_through_dict_and_json(policy):
    data = policy.to_dict()
    assert DeliveryPolicy.from_dict(data) == policy
    assert DeliveryPolicy.parse(json.dumps(data)) == policy
    assert DeliveryPolicy.parse(" " + json.dumps(data)) == policy
    assert DeliveryPolicy.parse(policy) is policy
    assert json.loads(json.dumps(data)) == data


@MORE
@given(policy=policies())
def test_the_schedule_has_num_retries_delays_in_bounds_never_decreasing(policy):
    delays = policy.retry_delays()
    low, high = policy.min_delay_target, policy.max_delay_target
    assert len(delays) == policy.num_retries == policy.total_attempts
    immediate = policy.num_no_delay_retries
    assert delays[:immediate] == [0.0] * immediate
    assert all(low <= d <= high for d in delays[immediate:])
    assert all(a <= b for a, b in zip(delays, delays[1:], strict=False))
    assert [policy.delay_before(i + 1) for i in range(len(delays))] == delays
    assert policy.total_duration() == pytest.approx(sum(delays), rel=1e-9, abs=1e-6)
    for bad in (0, policy.num_retries + 1):
        with pytest.raises(PolicyError, match=f"outside this policy's 1..{policy.num_retries}"):
            policy.delay_before(bad)


@MORE
@given(function=st.sampled_from(BACKOFF_FUNCTIONS), k=st.integers(0, MAX_RETRIES),
       bounds=st.tuples(st.integers(0, MAX_DELAY_TARGET), st.integers(0, MAX_DELAY_TARGET)).map(sorted))
def test_each_backoff_function_starts_at_min_ends_at_max_and_never_decreases(function, k, bounds):
    low, high = bounds
    delays = backoff(function, k, float(low), float(high))
    assert len(delays) == k
    if k:
        assert delays[0] == low and delays[-1] == (high if k > 1 else low)
    assert all(low <= d <= high for d in delays)
    assert all(a <= b for a, b in zip(delays, delays[1:], strict=False))


@MORE
@given(policy=policies(), fraction=st.floats(0, 1), seed=st.integers(0, 2**32))
def test_jitter_stays_within_its_fraction_and_the_policy_bounds(policy, fraction, seed):
    plain = policy.retry_delays()
    jittered = policy.retry_delays(jitter=fraction, seed=seed)
    assert jittered == policy.retry_delays(jitter=fraction, seed=seed)  # reproducible
    low, high = float(policy.min_delay_target), float(policy.max_delay_target)

    def clamp(x: float) -> float:
        return min(max(x, low), high)

    for d, j in zip(plain, jittered, strict=True):
        if d == 0:
            assert j == 0  # an immediate retry stays immediate
        else:
            assert low <= j <= high
            assert clamp(d * (1 - fraction)) <= j <= clamp(d * (1 + fraction))


RETRY_KEYS = ["minDelayTarget", "maxDelayTarget", "numRetries", "numNoDelayRetries", "numMinDelayRetries",
              "numMaxDelayRetries"]


@MORE
@given(values=st.dictionaries(st.sampled_from(RETRY_KEYS), st.integers(-50, 4000) | st.none() | st.text(max_size=3)
                              | st.booleans() | st.floats(0, 10), max_size=6),
       function=st.none() | st.sampled_from([*BACKOFF_FUNCTIONS, "cubic", "Linear", ""]),
       throttle=st.none() | st.integers(-3, 50) | st.just("10") | st.just(2.5))
@example(values={"maxDelayTarget": 10}, function=None, throttle=None)
@example(values={"numRetries": 2, "numMaxDelayRetries": 3}, function=None, throttle=None)
def test_policy_validation_accepts_exactly_the_allowed_ranges_and_names_the_attribute(values, function, throttle):
    retry = dict(values)
    if function is not None:
        retry["backoffFunction"] = function
    data = {"healthyRetryPolicy": retry}
    if throttle is not None:
        data["throttlePolicy"] = {"maxReceivesPerSecond": throttle}
    # an independent statement of the limits (docs/using.md, "Retry policies")
    full = {"minDelayTarget": 20, "maxDelayTarget": 20, "numRetries": 3, "numNoDelayRetries": 0,
            "numMinDelayRetries": 0, "numMaxDelayRetries": 0, **values}
    ints = {k: v for k, v in full.items() if type(v) is int}
    wrong = set(full) - set(ints)
    if throttle is not None and (type(throttle) is not int or throttle < 1):
        wrong.add("maxReceivesPerSecond")
    if function is not None and function not in BACKOFF_FUNCTIONS:
        wrong.add("backoffFunction")
    n, high, low = ints.get("numRetries"), ints.get("maxDelayTarget"), ints.get("minDelayTarget")
    phases = ["numNoDelayRetries", "numMinDelayRetries", "numMaxDelayRetries"]
    if n is not None and not 0 <= n <= MAX_RETRIES:
        wrong.add("numRetries")
    if high is not None and not 0 <= high <= MAX_DELAY_TARGET:
        wrong.add("maxDelayTarget")
    if low is not None and high is not None and not 0 <= low <= high:
        wrong |= {"minDelayTarget", "maxDelayTarget"}
    wrong |= {p for p in phases if p in ints and ints[p] < 0}
    if n is not None and all(p in ints for p in phases) and sum(ints[p] for p in phases) > n:
        wrong |= {"numRetries", *phases}
    if not wrong:
        policy = DeliveryPolicy.from_dict(data)
        assert DeliveryPolicy.from_dict(policy.to_dict()) == policy
        return
    with pytest.raises(PolicyError) as err:
        DeliveryPolicy.from_dict(data)
    text = str(err.value)
    assert isinstance(err.value, ValueError)
    assert any(name in text for name in wrong), (text, wrong)
    assert "allowed" in text or "must be an integer" in text


@FAST
@given(section=st.sampled_from(["healthyRetryPolicy", "throttlePolicy"]),
       value=st.one_of(st.lists(st.integers(), max_size=2), st.text(max_size=3), st.integers(), st.booleans(),
                       st.floats(allow_nan=False)))
@example(section="healthyRetryPolicy", value=[])  # a falsy non-object was read as "no attributes"
@example(section="throttlePolicy", value=0)
def test_a_policy_section_that_is_not_an_object_is_refused(section, value):
    with pytest.raises(PolicyError, match="healthyRetryPolicy and throttlePolicy must be JSON objects"):
        DeliveryPolicy.from_dict({section: value})


@FAST
@given(key=st.text(max_size=12), where=st.sampled_from(["", "healthyRetryPolicy", "throttlePolicy"]))
def test_unknown_policy_keys_are_refused_naming_them_and_the_allowed_ones(key, where):
    known = {"": {"healthyRetryPolicy", "throttlePolicy"}, "healthyRetryPolicy": set(RETRY_KEYS) | {"backoffFunction"},
             "throttlePolicy": {"maxReceivesPerSecond"}}[where]
    assume(key not in known)
    data = {key: {}} if not where else {where: {key: 1}}
    with pytest.raises(PolicyError) as err:
        DeliveryPolicy.from_dict(data)
    assert repr(key) in str(err.value) and "allowed" in str(err.value)


@FAST
@given(text=st.text(max_size=20))
def test_policy_text_is_json_or_a_builtin_name_and_anything_else_says_which(text):
    try:
        policy = DeliveryPolicy.parse(text)
    except PolicyError as exc:
        assert "not valid JSON" in str(exc) or "no built-in policy" in str(exc) or "allowed" in str(exc) \
            or "must be" in str(exc)
        return
    assert isinstance(policy, DeliveryPolicy)


# -- throttle ----------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@MORE
@given(rate=st.integers(1, 500) | st.floats(0.05, 500),
       steps=st.lists(st.tuples(st.floats(0, 3), st.integers(0, 1000)), min_size=1, max_size=60))
def test_a_token_bucket_never_gives_more_than_its_rate_over_any_window(rate, steps):
    """At most one second's worth (max(rate, 1)) plus `rate` per second in any window, and from a fresh
    bucket (starting nearly empty) at most min(1, rate) plus `rate` per second."""
    clock = Clock()
    start = clock.now
    bucket = TokenBucket(rate, clock=clock)
    taken: list[tuple[float, int]] = []
    for dt, n in steps:
        clock.now += dt
        got = bucket.take_up_to(n)
        assert 0 <= got <= n
        taken.append((clock.now, got))
    capacity, eps = max(rate, 1.0), 1e-6
    total = 0
    for i, (t_i, _) in enumerate(taken):
        window = 0
        for t_j, got in taken[i:]:
            window += got
            assert window <= capacity + rate * (t_j - t_i) + eps
    for t, got in taken:
        total += got
        assert total <= min(1.0, rate) + rate * (t - start) + eps


@MORE
@given(rate=st.integers(2, 500) | st.floats(2, 500), steps=st.lists(st.floats(0, 0.5), min_size=1, max_size=60))
def test_a_busy_token_bucket_loses_no_tokens(rate, steps):
    """A consumer that always asks for more than there is gets the full rate: what refilled while it was busy."""
    clock = Clock()
    bucket = TokenBucket(rate, clock=clock)
    total = bucket.take_up_to(10**6)
    for dt in steps:
        clock.now += dt
        total += bucket.take_up_to(10**6)
    assert total >= 1.0 + rate * sum(steps) - 1 - 1e-6


@FAST
@given(rate=st.floats(max_value=0) | st.integers(max_value=0))
def test_a_token_bucket_refuses_a_rate_of_0_or_less(rate):
    with pytest.raises(ValueError, match="rate must be > 0"):
        TokenBucket(rate)


def test_random_is_only_used_seeded():
    """retry_delays(seed=...) must not touch the global generator (reproducible runs elsewhere)."""
    state = random.getstate()
    DeliveryPolicy(1, 100, 10, backoff_function="exponential").retry_delays(jitter=0.5, seed=1)
    assert random.getstate() == state


def test_sections_that_are_null_mean_the_defaults():
    assert DeliveryPolicy.from_dict({"healthyRetryPolicy": None, "throttlePolicy": None}) == DeliveryPolicy()

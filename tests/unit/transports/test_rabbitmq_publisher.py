"""The publisher's own frame encoding is byte for byte what pika encodes (no broker needed)."""

import pika
import pika.frame
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_delay_provider.transports.rabbitmq.publisher import Publication, body_frames, header_frame

_header_values = st.one_of(st.text(max_size=300), st.integers(-(2**63), 2**63 - 1), st.booleans())


@settings(max_examples=300, deadline=None)
@given(channel=st.integers(1, 2047), message_id=st.text(min_size=1, max_size=80),
       headers=st.dictionaries(st.text(min_size=1, max_size=60), _header_values, max_size=6),
       body=st.binary(max_size=300))
def test_the_header_frame_is_the_bytes_pika_encodes(channel, message_id, headers, body):
    ours = header_frame(channel, Publication(message_id, "", "q", body, headers))
    properties = pika.BasicProperties(message_id=message_id, headers=headers, delivery_mode=2)
    assert ours == pika.frame.Header(channel, len(body), properties).marshal()


@settings(max_examples=200, deadline=None)
@given(channel=st.integers(1, 2047), body=st.binary(max_size=3000), max_length=st.integers(1, 1100))
def test_the_body_frames_are_the_bytes_pika_encodes(channel, body, max_length):
    ours: list[bytes] = []
    body_frames(ours, channel, body, max_length)
    pieces = [body[i:i + max_length] for i in range(0, len(body), max_length)]
    assert ours == [pika.frame.Body(channel, piece).marshal() for piece in pieces]

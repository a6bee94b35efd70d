"""Message bodies on SQS: text as SQS keeps it (base64 when it would not), and bodies too large for SQS
stored in an S3 bucket, the message carrying a pointer; reading, deleting and expiring those objects."""

from __future__ import annotations

import base64
import json
import logging
import math
import re
import uuid
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from airflow_delay_provider.core.errors import DelayError, InvalidInputError, UnavailableError
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.transports.sqs.wire import ATTR_BODY_S3, ATTR_ENCODING, _attr, _aws_error, _code

log = logging.getLogger(__name__)

#: Large bodies expire after the longest delay the operators take by default (7 days), plus the longest a
#: destination queue keeps a message (14 days), plus a relay outage as long as the delay queue's retention.
BODY_EXPIRATION_DAYS = 35
#: What a large body must outlive beside its delay: a destination queue's 14 days and 14 of relay downtime.
_BODY_MARGIN_DAYS = BODY_EXPIRATION_DAYS - 7
BODY_KEY_PREFIX = "delay-bodies/"
#: Bodies above this go to S3: SQS's old 256 KiB limit, which every SQS (and moto) accepts.
MAX_BODY_BYTES = 256 * 1024 - 8 * 1024  # room left for the attributes


class Bodies:
    """A transport's bodies: each in its message, or, over `max_bytes`, an object in the S3 bucket `bucket`
    (through the client `s3`) under `<prefix>delay-bodies/` that the message points to; without a bucket such
    a body is refused."""

    def __init__(self, s3: Any, bucket: str | None, prefix: str, max_bytes: int, expiration_days: int) -> None:
        self.s3 = s3
        self.bucket = bucket
        self.prefix = prefix
        self.max_bytes = max_bytes
        self.expiration_days = expiration_days

    def body(self, m: DelayedMessage, attributes: dict[str, Any]) -> str:
        """The SQS body; one over the size limit goes to S3 and the message carries a pointer."""
        body = _encode_body(m.body, attributes)
        if len(body.encode()) <= self.max_bytes:
            return body
        if not self.bucket:
            raise InvalidInputError(
                f"message {m.message_id} has a body of {len(body.encode())} bytes; SQS takes {self.max_bytes}: "
                "set large_body_bucket to carry larger bodies through S3"
            )
        key = f"{self.prefix}{BODY_KEY_PREFIX}{uuid.uuid4().hex}"
        try:
            self.s3.put_object(Bucket=self.bucket, Key=key, Body=m.body)
        except (ClientError, BotoCoreError) as exc:
            raise UnavailableError(
                f"could not store the large body of {m.message_id} in S3: {_aws_error(exc)}") from None
        attributes.pop(ATTR_ENCODING, None)
        attributes[ATTR_BODY_S3] = {"DataType": "String", "StringValue": f"{self.bucket}/{key}"}
        return json.dumps({"s3": f"{self.bucket}/{key}"})

    def check_delay(self, m: DelayedMessage, seconds: int) -> None:
        """Refuse a body that goes to S3 and would expire there before it is delivered and read: it must outlive its
        delay plus 28 days (a destination queue's 14, and 14 of relay downtime)."""
        needed = math.ceil(seconds / 86_400) + _BODY_MARGIN_DAYS
        if needed <= self.expiration_days or len(_encode_body(m.body, {}).encode()) <= self.max_bytes:
            return
        raise DelayError(
            f"message {m.message_id} has a body too large for SQS, carried through S3, where it expires after "
            f"body_expiration_days ({self.expiration_days}); its delay of {seconds} s needs at least {needed} days "
            f"(the delay, plus {_BODY_MARGIN_DAYS} for a destination queue's retention and relay downtime): set the "
            "connection's body_expiration_days extra to that, or send a smaller body")

    def expire(self) -> int:
        """A lifecycle rule expiring this prefix's large bodies: those whose message was never acked
        (a send that failed after the upload, a message that expired) would otherwise stay forever."""
        bucket, key_prefix = self.bucket, f"{self.prefix}{BODY_KEY_PREFIX}"
        rule_id = f"airflow-delay-provider {key_prefix}"
        try:
            try:
                current = self.s3.get_bucket_lifecycle_configuration(Bucket=bucket)
            except ClientError as exc:
                if _code(exc) != "NoSuchLifecycleConfiguration":
                    raise
                current = {}
            # A put replaces the bucket's whole configuration: keep every rule but ours.
            rules = [r for r in current.get("Rules", []) if r.get("ID") != rule_id]
            rules.append({"ID": rule_id, "Status": "Enabled", "Filter": {"Prefix": key_prefix},
                          "Expiration": {"Days": self.expiration_days}})
            extra = {k: current[k] for k in ("TransitionDefaultMinimumObjectSize",) if current.get(k)}
            self.s3.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": rules}, **extra)
        except ClientError as exc:
            raise InvalidInputError(
                f"could not set the expiry of large bodies on S3 bucket {bucket!r} (it must exist and allow "
                f"s3:GetLifecycleConfiguration and s3:PutLifecycleConfiguration): {_aws_error(exc)}") from None
        except BotoCoreError as exc:
            raise UnavailableError(f"could not reach S3: {_aws_error(exc)}") from None
        return self.expiration_days

    def read(self, pointer: str, message_id: str) -> bytes | None:
        """The body at `pointer` (`<bucket>/<key>`), or None when it is gone; UnavailableError when S3 fails."""
        bucket, key = pointer.split("/", 1)
        try:
            body: bytes = self.s3.get_object(Bucket=bucket, Key=key)["Body"].read()
            return body
        except ClientError as exc:
            if _code(exc) not in ("NoSuchKey", "404"):
                raise UnavailableError(
                    f"could not read the large body of {message_id} from S3: {_aws_error(exc)}") from None
        except BotoCoreError as exc:
            raise UnavailableError(
                f"could not read the large body of {message_id} from S3: {_aws_error(exc)}") from None
        return None

    def peek(self, pointer: str) -> bytes:
        bucket, key = pointer.split("/", 1)
        try:
            body: bytes = self.s3.get_object(Bucket=bucket, Key=key)["Body"].read()
            return body
        except (ClientError, BotoCoreError, AttributeError):
            return b""  # gone (or no S3 client): the listing says so; nothing is deleted while peeking

    def delete(self, pointer: str) -> None:
        bucket, key = pointer.split("/", 1)
        try:
            self.s3.delete_object(Bucket=bucket, Key=key)
        except (ClientError, BotoCoreError) as exc:
            log.warning("could not delete the large body %s from S3 (its lifecycle rule will): %s", pointer,
                        _aws_error(exc))


#: Characters SQS keeps in a body (XML 1.0's); it refuses others or replaces them with U+FFFD.
_SQS_TEXT = re.compile("[\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]*")


def _encode_body(body: bytes, attributes: dict[str, Any]) -> str:
    """SQS bodies are text: UTF-8 as is when SQS keeps every character, anything else base64 with an
    attribute saying so."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and _SQS_TEXT.fullmatch(text):
        return text
    attributes[ATTR_ENCODING] = {"DataType": "String", "StringValue": "base64"}
    return base64.b64encode(body).decode("ascii")


def _decode_body(message: dict[str, Any]) -> bytes:
    if _attr(message, ATTR_ENCODING) == "base64":
        return base64.b64decode(message["Body"])
    text: str = message["Body"]
    return text.encode("utf-8")

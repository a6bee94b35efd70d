"""The delivery policies a pump applies per destination, and the throttles they set.

A destination's policy is the task's own for it, else the one stored for it (set when it was provisioned), else
the task's default. A policy with `max_receives_per_second` throttles its destination: every pump of a store that
can keep one bucket for all of them (PostgreSQL) takes from that shared bucket, others from their share of it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import datetime
from functools import partial

from airflow_delay_provider.core.errors import StoreNotReadyError
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.ports import DelayedMessageStore
from airflow_delay_provider.core.retry_policy import DeliveryPolicy, PolicyError
from airflow_delay_provider.core.throttle import SharedBucket, TokenBucket

log = logging.getLogger("airflow_delay_provider.core.pump")


class DestinationPolicies:
    """The policies and throttle buckets of one pump.

    :param throttle_share: the share of a throttled destination's rate this pump may take where the store keeps no
        shared bucket (several pumps of a sweep's partitions split it).
    :param clock: the pump's clock (the store's), on which a bucket of its own refills.
    """

    def __init__(self, store: DelayedMessageStore, policy: DeliveryPolicy, policies: Mapping[str, DeliveryPolicy],
                 clock: Callable[[], datetime], throttle_share: float = 1.0) -> None:
        self.store = store
        self.policy = policy
        self.policies = dict(policies)
        self.throttle_share = throttle_share
        self._clock = clock
        self._stored: dict[str, DeliveryPolicy] = {}
        self._buckets: dict[str, TokenBucket | SharedBucket] = {}

    def policy_for(self, destination: str) -> DeliveryPolicy:
        """The task's policy for the destination, else the one stored for it, else the task's default."""
        return self.policies.get(destination) or self._stored.get(destination, self.policy)

    def load_stored(self) -> None:
        try:
            stored = self.store.policies()
        except StoreNotReadyError:  # not provisioned yet: the claims wait for it, and say so once a minute
            return
        except Exception as exc:  # the claims will meet the same problem, under the fetch breaker
            log.warning("could not read stored delivery policies: %s", exc)
            return
        self._stored = {}
        for destination, data in stored.items():
            try:
                self._stored[destination] = DeliveryPolicy.from_dict(data)
            except PolicyError as exc:
                log.error("ignoring the stored delivery policy of %s: %s", destination, exc)

    def move_exclusions(self) -> set[str] | None:
        """The destinations a transport's move must leave to claims, read with the store's policies: the throttled
        ones, which go at their rate. None when the default policy is throttled: nothing may be moved."""
        self.load_stored()
        if self.policy.max_receives_per_second is not None:
            return None
        policies = {**self._stored, **self.policies}
        return {d for d, p in policies.items() if p.max_receives_per_second is not None}

    def _bucket(self, destination: str) -> TokenBucket | SharedBucket | None:
        rate = self.policy_for(destination).max_receives_per_second
        if rate is None:
            return None
        if destination not in self._buckets:
            if self.store.shared_throttle:  # every pump of the store takes from one bucket
                take = partial(self.store.take_tokens, destination, rate)
                self._buckets[destination] = SharedBucket(rate, take)
            else:  # this pump's own share of the rate
                self._buckets[destination] = TokenBucket(rate * self.throttle_share,
                                                         clock=lambda: self._clock().timestamp())
        return self._buckets[destination]

    def throttled_out(self) -> set[str]:
        """Destinations with no token left: not even claimed until their bucket refills."""
        return {d for d, bucket in self._buckets.items() if bucket.empty()}

    def within_throttle(self, messages: list[DelayedMessage]) -> list[DelayedMessage]:
        """The messages that may go now; the rest stay in the claim unsettled and are restored."""
        allowed: dict[str, int] = {}
        wanted: dict[str, int] = {}
        for m in messages:
            wanted[m.destination] = wanted.get(m.destination, 0) + 1
        for destination, n in wanted.items():
            bucket = self._bucket(destination)
            allowed[destination] = n if bucket is None else bucket.take_up_to(n)
        sendable = []
        for m in messages:
            if allowed[m.destination] > 0:
                allowed[m.destination] -= 1
                sendable.append(m)
        return sendable

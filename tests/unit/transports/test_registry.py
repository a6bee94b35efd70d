"""The transport registry's check of the options DAG authors give (no Airflow, no services)."""

from __future__ import annotations

import pytest

from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.transports.registry import check_options


@pytest.mark.parametrize("transport", ["sql", "rabbitmq"])
def test_a_transport_that_takes_no_transport_options_refuses_any_naming_itself(transport):
    with pytest.raises(InvalidInputError, match=rf"^transport='{transport}' takes no transport_options, got "
                                                r"\['prefix', 'queue_delay'\]; only \[[^]]*'sqs'[^]]*\] take any$"):
        check_options(transport, {"queue_delay": 5, "prefix": "prod-"})
    assert check_options(transport, {}) == {}


def test_a_transport_with_options_takes_its_own_and_refuses_others_listing_them():
    assert check_options("sqs", {"prefix": "prod-", "queue_delay": 60}) == {"prefix": "prod-", "queue_delay": 60}
    with pytest.raises(InvalidInputError, match=r"transport_options \['Prefix'\] are not known for "
                                                r"transport='sqs'; allowed: \[.*'prefix'"):
        check_options("sqs", {"Prefix": "prod-"})


def test_endpoint_options_are_checked_per_transport():
    assert check_options("sql", {"queue_delay_seconds": 30}, "endpoint_options") == {"queue_delay_seconds": 30}
    with pytest.raises(InvalidInputError, match=r"endpoint_options \['unrestricted'\] are not known for "
                                                r"transport='rabbitmq'; allowed: \['queue_delay_seconds'\]"):
        check_options("rabbitmq", {"unrestricted": True}, "endpoint_options")

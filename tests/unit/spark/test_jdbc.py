"""The JDBC reader's connection: the store's URL as pgjdbc takes it, TLS settings included (no Spark needed)."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import make_url

from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.spark.jdbc import connection, jdbc_url

BASE = {"driver": "org.postgresql.Driver", "fetchsize": "10000"}


def test_the_stores_tls_settings_become_pgjdbc_properties_and_its_session_settings_stay_out():
    url = make_url("postgresql+psycopg://u:pw@db.internal:6432/store?sslmode=verify-full&sslrootcert=/etc/ca.pem"
                   "&sslcert=/etc/client.crt&sslkey=/etc/client.pk8&sslpassword=key-pw&gssencmode=disable"
                   "&lock_timeout=60s&idle_in_transaction_session_timeout=5min&application_name=sweeps")
    address, properties = connection(url)
    assert address == "jdbc:postgresql://db.internal:6432/store"  # nothing of the query: no setting, no secret
    assert properties == {**BASE, "user": "u", "password": "pw", "sslmode": "verify-full",
                          "sslrootcert": "/etc/ca.pem", "sslcert": "/etc/client.crt", "sslkey": "/etc/client.pk8",
                          "sslpassword": "key-pw", "gssEncMode": "disable"}


def test_without_tls_settings_pgjdbc_keeps_its_defaults_which_are_libpqs():
    assert connection(make_url("postgresql+psycopg://u@db.internal/store")) == (
        "jdbc:postgresql://db.internal:5432/store", {**BASE, "user": "u"})


def test_the_systems_certificate_authorities_are_javas_default_trust_store():
    # libpq 16: sslrootcert=system verifies against the system's CAs and implies verify-full.
    _, properties = connection(make_url("postgresql+psycopg://u@db.internal/store?sslrootcert=system"))
    assert properties == {**BASE, "user": "u", "sslfactory": "org.postgresql.ssl.DefaultJavaSSLFactory",
                          "sslmode": "verify-full"}
    _, properties = connection(make_url("postgresql+psycopg://u@db/store?sslrootcert=system&sslmode=verify-ca"))
    assert properties["sslmode"] == "verify-ca" and "sslrootcert" not in properties


@pytest.mark.parametrize("setting", ["sslcrl=/etc/crl.pem", "sslcrldir=/etc/crl", "ssl_min_protocol_version=TLSv1.3",
                                     "channel_binding=require", "require_auth=scram-sha-256"])
def test_a_security_setting_pgjdbc_cannot_honour_is_refused_rather_than_dropped(setting):
    name = setting.split("=")[0]
    with pytest.raises(InvalidInputError, match=f"{name}.*reader='direct'") as refused:
        connection(make_url(f"postgresql+psycopg://u:secret-pw@db.internal/store?{setting}"))
    assert "secret-pw" not in str(refused.value)


def test_the_jdbc_reader_never_reads_a_host_less_url_as_localhost():
    assert jdbc_url(make_url("postgresql+psycopg://u:pw@db.internal/store")) == "jdbc:postgresql://db.internal:5432/store"
    with pytest.raises(InvalidInputError, match="no host .*Unix socket.*reader='direct'"):
        jdbc_url(make_url("postgresql+psycopg://u@/store"))


def test_the_sweep_refuses_such_a_store_for_the_jdbc_reader_before_it_leases_anything():
    from airflow_delay_provider.spark.sweep import resolve_reader
    from airflow_delay_provider.stores.sql import SqlDelayedMessageStore

    store = SqlDelayedMessageStore("postgresql+psycopg://u@db.internal/store?sslcrl=/etc/crl.pem")  # connects lazily
    with pytest.raises(InvalidInputError, match="sslcrl"):
        resolve_reader("jdbc", store)
    assert resolve_reader("auto", store) == "direct"  # psycopg honours it

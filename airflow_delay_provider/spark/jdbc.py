"""How the JDBC reader connects to a PostgreSQL store: the store's SQLAlchemy URL as pgjdbc takes it.

The store's URL is libpq's (psycopg's): its query may hold TLS settings (`sslmode`, `sslrootcert`, ...) and the
store's own session settings (`lock_timeout`, see stores/engine.py). pgjdbc names the TLS settings as libpq
does, so they go over as connection properties, and the read is as protected as the store's own connections;
a security setting pgjdbc has no property for refuses the read rather than being dropped. The rest of the
query means nothing to pgjdbc and stays out. Nothing goes in the JDBC URL but host, port and database: the
password and the key's password travel as properties, which Spark redacts wherever it shows options.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import URL

from airflow_delay_provider.core.errors import InvalidInputError, UnavailableError

#: libpq's name in the store's URL -> pgjdbc's property (checked against pgjdbc 42.5's PGProperty).
PROPERTIES = {"sslmode": "sslmode", "sslrootcert": "sslrootcert", "sslcert": "sslcert", "sslkey": "sslkey",
              "sslpassword": "sslpassword", "gssencmode": "gssEncMode"}
#: libpq security settings pgjdbc has no property for: without them the read would be less protected than the store.
UNSUPPORTED = ("sslcrl", "sslcrldir", "sslcertmode", "sslnegotiation", "ssl_min_protocol_version",
               "ssl_max_protocol_version", "channel_binding", "require_auth")
#: pgjdbc's factory that trusts the JVM's certificate authorities: libpq's `sslrootcert=system`.
SYSTEM_TRUST = "org.postgresql.ssl.DefaultJavaSSLFactory"


def jdbc_url(url: URL) -> str:
    """The JDBC URL of a PostgreSQL store's SQLAlchemy URL. JDBC connects over TCP only: a URL without a
    host (a Unix socket) is refused rather than read as localhost, which an executor elsewhere is not."""
    if not url.host:
        raise InvalidInputError(
            "the store's URL has no host (it connects through a Unix socket), and the JDBC reader connects over "
            "TCP from every executor: give the store's connection a host name the executors can reach, or use "
            "reader='direct'")
    return f"jdbc:postgresql://{url.host}:{url.port or 5432}/{url.database}"


def connection(url: URL) -> tuple[str, dict[str, str]]:
    """The JDBC URL and the connection properties (credentials and TLS settings) of the store's URL."""
    refused = sorted(name for name in url.query if name in UNSUPPORTED)
    if refused:
        raise InvalidInputError(
            f"the store's URL sets {', '.join(refused)}, which the PostgreSQL JDBC driver cannot honour: the JDBC "
            "reader would connect less protected than the store does; use reader='direct' (the default)")
    properties = {"driver": "org.postgresql.Driver", "fetchsize": "10000"}
    if url.username:
        properties["user"] = url.username
    if url.password:
        properties["password"] = str(url.password)
    for name, value in url.query.items():
        if name in PROPERTIES:
            properties[PROPERTIES[name]] = value if isinstance(value, str) else value[-1]
    if properties.get("sslrootcert") == "system":  # libpq 16: the system's CAs, and verify-full unless told
        del properties["sslrootcert"]
        properties["sslfactory"] = SYSTEM_TRUST
        properties.setdefault("sslmode", "verify-full")
    return jdbc_url(url), properties


def read(spark: Any, url: URL, table: str, predicates: list[str]) -> Any:
    """The rows of `table` (a quoted name) that `predicates` select, one partition each, as a DataFrame.

    Spark reports a failed connection as "Couldn't connect to the database"; the error says why, from pgjdbc's
    own exception beneath it (e.g. "The server does not support SSL." for sslmode=require)."""
    address, properties = connection(url)
    try:
        return spark.read.jdbc(address, table, predicates=predicates, properties=properties)
    except Exception as exc:
        causes = []
        cause = getattr(exc, "_origin", None)  # the Java exception PySpark captured, when there is one
        while cause is not None and len(causes) < 10:
            causes.append(str(cause.getMessage() or cause.getClass().getName()))
            cause = cause.getCause()
        why = " <- ".join(causes) or str(exc)
        for secret in (properties.get("password"), properties.get("sslpassword")):
            why = why.replace(secret, "***") if secret else why
        tls = properties.get("sslmode", "pgjdbc's default, prefer")
        raise UnavailableError(f"the JDBC reader could not read the store at {address} (sslmode: {tls}): {why}") \
            from None

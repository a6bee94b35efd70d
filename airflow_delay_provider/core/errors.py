"""The provider's exceptions: one small hierarchy, each message says what was wrong and what is allowed."""

from __future__ import annotations


class DelayProviderError(Exception):
    """Base of every error this package raises on purpose."""


class InvalidInputError(DelayProviderError, ValueError):
    """A value given by the caller is outside what is allowed; nothing was stored or sent."""


class DelayError(InvalidInputError):
    """A delay is not an int in the allowed range."""


class InvalidNameError(InvalidInputError):
    """A table, schema, queue or destination name is not allowed."""


class InvalidMessageError(InvalidInputError):
    """A message id, body or header is not allowed."""


class DestinationNotFoundError(DelayProviderError):
    """The destination queue does not exist; the message cannot be delivered until it is provisioned."""


class UnavailableError(DelayProviderError, ConnectionError):
    """A store or broker could not be reached."""


class CriticalError(DelayProviderError):
    """A circuit breaker tripped: failures went on for longer than allowed, so the work stops loudly."""


class UnknownDestinationError(InvalidInputError):
    """A backlog action named a destination the store has never provisioned nor taken messages for."""


class ConnectionTypeError(InvalidInputError):
    """A connection of another type than the one asked for (a `postgres` or `rabbitmq` connection given as the
    store's): refused before anything is opened."""


class StoreNotReadyError(DelayProviderError):
    """The store's tables (or the SQL-table queues') are not there yet, or older than this release: its message
    names the connection, database, schema and tables, and what to run. Reads never create them; writers do only
    where the connection's `auto_migrate` allows it, and a dispatcher waits for them."""

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


class ConnectionSetupError(DelayProviderError):
    """A connection that is not defined, or lacks a setting the broker needs (an AWS region): the message says
    what to create or set."""


#: What each extra of the distribution installs, and the features that need it.
EXTRAS = {
    "amazon": "SQS (transport='sqs', SqsDelayHook, RelayDelayedMessagesOperator, SqsDelayQueueTrigger) needs the "
              "amazon provider and boto3",
    "spark": "Spark sweeps (BulkSweepOperator, airflow_delay_provider.spark) need the Spark provider and PySpark",
    "messaging": "The `delay` scheme of MessageQueueTrigger (airflow_delay_provider.queues.delay) needs the common "
                 "messaging provider",
}


class MissingExtraError(DelayProviderError, ImportError):
    """An optional feature used without the extra of this distribution that installs it; an ImportError too, so
    code that tries an import and falls back still works."""


def extra_message(extra: str, cause: ImportError) -> str:
    """What needs `extra`, what was missing (`cause`) and the pip line that installs it."""
    return (f"{EXTRAS[extra]}, which are not installed ({cause}): pip install \"airflow-delay-provider[{extra}]\" "
            "with the constraints file of your Airflow and Python versions")


def missing_extra(extra: str, cause: ImportError) -> MissingExtraError:
    """The error for a feature of `extra` whose import failed with `cause`."""
    return MissingExtraError(extra_message(extra, cause), name=cause.name)

"""Provider metadata read by Airflow through the `apache_airflow_provider` entry point.

It lists no `plugins`: the backlog page's plugin has the `airflow.plugins` entry point (pyproject.toml),
which Airflow always loads; listed here too, it would be loaded a second time with ``[core]
lazy_discover_providers = False`` and reported as a plugin import error.
"""

from __future__ import annotations

from airflow_delay_provider import __version__

INTEGRATION = "Delayed Delivery"


def get_provider_info() -> dict:
    return {
        "package-name": "airflow-delay-provider",
        "name": "Delayed Delivery",
        "description": "Durable, exact delayed delivery of messages: a SQL store of delayed messages with a "
        "batched dispatch pump, and native delays on RabbitMQ and Amazon SQS.",
        "versions": [__version__],
        "integrations": [{"integration-name": INTEGRATION, "tags": ["service"]}],
        "hooks": [{"integration-name": INTEGRATION, "python-modules": [
            "airflow_delay_provider.hooks.delay_store", "airflow_delay_provider.hooks.rabbitmq",
            "airflow_delay_provider.hooks.sqs"]}],
        "operators": [{"integration-name": INTEGRATION, "python-modules": [
            "airflow_delay_provider.operators.provision", "airflow_delay_provider.operators.send",
            "airflow_delay_provider.operators.dispatch", "airflow_delay_provider.operators.migrate",
            "airflow_delay_provider.operators.sqs", "airflow_delay_provider.operators.sweep",
            "airflow_delay_provider.operators.backlog", "airflow_delay_provider.operators.redrive",
            "airflow_delay_provider.operators.schedule"]}],
        "sensors": [{"integration-name": INTEGRATION, "python-modules": [
            "airflow_delay_provider.sensors.delay_store"]}],
        "triggers": [{"integration-name": INTEGRATION, "python-modules": [
            "airflow_delay_provider.triggers.delay_store", "airflow_delay_provider.triggers.sqs",
            "airflow_delay_provider.triggers.asset"]}],
        # The `delay` scheme of MessageQueueTrigger (the messaging extra; without it Airflow turns it off).
        "queues": ["airflow_delay_provider.queues.delay.DelayMessageQueueProvider"],
        "cli": ["airflow_delay_provider.cli.definition.get_delay_cli_commands"],
        # The send and dispatch tasks' buttons to the Delayed messages page (the api-server builds them from here).
        "extra-links": ["airflow_delay_provider.links.SentMessagesLink",
                        "airflow_delay_provider.links.DestinationsLink"],
        "connection-types": [
            {
                "hook-class-name": "airflow_delay_provider.hooks.delay_store.DelayStoreHook",
                "hook-name": "Delay Store (SQL)",
                "connection-type": "delay_store",
                "conn-fields": {
                    "driver": {
                        "label": "SQLAlchemy driver",
                        "schema": {
                            "type": ["string", "null"],
                            "default": "postgresql+psycopg",
                            "enum": ["postgresql+psycopg", "sqlite"],
                        },
                        "description": "postgresql+psycopg, or sqlite (then Database is the file path)",
                    },
                    "url": {
                        "label": "SQLAlchemy URL (instead of the fields)",
                        "schema": {"type": ["string", "null"]},
                        "description": "Put the password in the Password field, not in the URL",
                    },
                    "table": {
                        "label": "Store table",
                        "schema": {"type": ["string", "null"], "default": "delayed_messages",
                                   "pattern": "^[A-Za-z_][A-Za-z0-9_]{0,53}$"},
                        "description": "At most 54 characters: the store also creates <table>_policies and friends",
                    },
                    "dedup_window_seconds": {
                        "label": "De-duplication window (s)",
                        "schema": {"type": ["number", "null"], "default": 86400, "minimum": 0},
                        "description": "How long a stored or sent message id is not accepted again (0: off)",
                    },
                    "max_delay_seconds": {
                        "label": "Longest delay (s)",
                        "schema": {"type": ["integer", "null"], "default": 604800, "minimum": 1,
                                   "maximum": 315576000},
                        "description": "The longest delay a send or reschedule may ask for: 7 days by default, up to "
                                       "ten years (315576000)",
                    },
                    "max_delay_seconds_per_destination": {
                        "label": "Longest delay per destination",
                        "schema": {"type": ["object", "null"], "additionalProperties": {
                            "type": "integer", "minimum": 1, "maximum": 315576000}},
                        "description": 'Destinations with a longest delay of their own: {"renewals": 31557600}',
                    },
                    "history_days": {
                        "label": "Days of delivery history",
                        "schema": {"type": ["integer", "null"], "default": 7, "minimum": 0, "maximum": 90},
                        "description": "What became of each message (delivered, retried, dead-lettered, cancelled) "
                                       "is kept this many days for the page and `airflow delayed-messages history` "
                                       "(0: none is kept)",
                    },
                    "db_schema": {
                        "label": "Database schema (PostgreSQL)",
                        "schema": {"type": ["string", "null"], "pattern": "^[A-Za-z_][A-Za-z0-9_]{0,62}$"},
                    },
                    "auto_migrate": {
                        "label": "Writers create and upgrade the tables",
                        "schema": {"type": ["boolean", "null"]},
                        "description": "Sends and dispatchers create the store's tables or bring them up to date "
                                       "(empty: yes on SQLite, no on PostgreSQL, where provisioning or `airflow "
                                       "delayed-messages db upgrade` does it)",
                    },
                },
                "ui-field-behaviour": {
                    "hidden-fields": ["extra"],
                    "relabeling": {"schema": "Database"},
                    "placeholders": {"host": "127.0.0.1", "port": "5432", "schema": "airflow_delays"},
                },
            },
            {
                "hook-class-name": "airflow_delay_provider.hooks.rabbitmq.RabbitMQDelayHook",
                "hook-name": "RabbitMQ (delayed delivery)",
                "connection-type": "rabbitmq",
                "conn-fields": {
                    "heartbeat": {"label": "Heartbeat (s)",
                                  "schema": {"type": ["integer", "null"], "default": 60, "minimum": 0}},
                    "tls": {"label": "Use TLS", "schema": {"type": ["boolean", "null"], "default": False}},
                    "tls_verify": {"label": "Verify the TLS certificate",
                                   "schema": {"type": ["boolean", "null"], "default": True}},
                    "prefix": {
                        "label": "Delay topology prefix",
                        "schema": {"type": ["string", "null"], "default": "delay"},
                        "description": "Exchanges and queues are named <prefix>.level-27 .. <prefix>.level-00, "
                                       "<prefix>.delivery",
                    },
                    "levels": {"label": "Delay levels",
                               "schema": {"type": ["integer", "null"], "default": 28, "minimum": 1, "maximum": 28}},
                    "confirm_window": {
                        "label": "Publisher confirms in flight",
                        "schema": {"type": ["integer", "null"], "default": 1000, "minimum": 1},
                    },
                    "delivery_limit": {
                        "label": "Redeliveries before poison",
                        "schema": {"type": ["integer", "null"], "default": 20, "minimum": 1},
                        "description": "x-delivery-limit of endpoint queues; past it a message goes to <prefix>.poison",
                    },
                },
                "ui-field-behaviour": {
                    "hidden-fields": ["extra"],
                    "relabeling": {"schema": "Virtual host"},
                    "placeholders": {"host": "127.0.0.1", "port": "5672", "schema": "/", "login": "guest"},
                },
            },
        ],
    }

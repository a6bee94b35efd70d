"""The `airflow delayed-messages` command group, registered through the provider's `cli` entry.

Every command acts through DelayStoreHook's backlog methods, as the operators and the UI page do, and prints its
report as `--output` says (a table on a terminal, JSON in a pipe); `db upgrade` creates or upgrades the store's
tables, the only command that does. Airflow imports this module at every `airflow` invocation, to build its
parser: it imports nothing but Airflow's CLI definitions, and each command's code is loaded when it runs.
"""

from __future__ import annotations

from airflow.cli.cli_config import ActionCommand, Arg, GroupCommand, lazy_load_command

_COMMANDS = "airflow_delay_provider.cli.commands."

ARG_CONN_ID = Arg(("--conn-id",), help="the delay_store connection (default: delay_store_default)",
                  default="delay_store_default")
ARG_TABLE = Arg(("--table",), help="the store's table (default: the connection's)")
ARG_DB_SCHEMA = Arg(("--db-schema",), help="the store's PostgreSQL schema (default: the connection's)")
ARG_IDS = Arg(("--id",), dest="message_ids", action="append", metavar="MESSAGE_ID",
              help="a message id (repeat for several, or separate them with commas)")
ARG_DESTINATION = Arg(("--destination",), help="only this destination's messages")
ARG_HEADER = Arg(("--header",), dest="headers", action="append", metavar="KEY=VALUE",
                 help="only messages with this header value (repeat: all must match)")
ARG_DUE_FROM = Arg(("--due-from",), help="due at or after this ISO time (with offset)")
ARG_DUE_BEFORE = Arg(("--due-before",), help="due before this ISO time (with offset)")
ARG_BODY_CONTAINS = Arg(("--body-contains",), metavar="TEXT",
                        help="only messages whose body contains this text (UTF-8, case matters; at most 200 "
                             "characters)")
ARG_ACTION_DRY_RUN = Arg(("--dry-run",), action="store_true",
                         help="only count the messages it would change (and those a sweep holds); change nothing")
ARG_ASSUME_YES = Arg(("-y", "--yes"), action="store_true",
                     help="do not ask first: a change by a filter that would touch more than 1,000 messages asks on a "
                          "terminal, and is refused elsewhere without this")
ARG_LIMIT = Arg(("--limit",), type=int, default=50, help="messages per page (1..1000, default 50)")
ARG_AFTER = Arg(("--after",), help="the `next` cursor printed by the previous page")
ARG_NO_BODIES = Arg(("--no-bodies",), action="store_true", help="show body sizes only")
ARG_DELIVER_AT = Arg(("--deliver-at",), help="the new due time, an ISO time with offset (not in the past)")
ARG_DELAY = Arg(("--delay-seconds",), type=float, help="the new due time, seconds from now (0: run now)")
ARG_EDIT_ID = Arg(("message_id",), metavar="MESSAGE_ID", help="the scheduled message to edit")
ARG_BODY = Arg(("--body",), help="its new body (UTF-8 text)")
ARG_SET_HEADER = Arg(("--set-header",), dest="set_headers", action="append", metavar="KEY=VALUE",
                     help="its new headers (repeat for several; they replace all of its headers)")
ARG_DESTINATIONS = Arg(("destinations",), nargs="+", metavar="DESTINATION", help="the destinations")
ARG_PURGE_DESTINATION = Arg(("--destination",), help="the destination whose scheduled messages go")
# The destination as a positional argument, as purge took it first: kept for existing scripts.
ARG_OLD_DESTINATION = Arg(("old_destination",), nargs="?", metavar="DESTINATION",
                          help="deprecated: write --destination DESTINATION")
ARG_YES = Arg(("--yes",), action="store_true", help="really purge (without it: a dry run that only counts)")
ARG_DEAD_LETTERS_ACTION = Arg(("action",), nargs="?", choices=("list", "delete"), default="list",
                              metavar="{list,delete}",
                              help="list (the default): show them; delete: remove them from the error queue "
                                   "(a dry run without --yes)")
ARG_ALL = Arg(("--all",), action="store_true", help="delete: every dead letter of the error queue")
ARG_DELETE_YES = Arg(("--yes",), action="store_true",
                     help="delete: really delete (without it: a dry run that lists what would go)")
ARG_OUTPUT = Arg(("-o", "--output"), choices=("table", "json", "yaml", "plain"), metavar="(table, json, yaml, plain)",
                 help="Output format. Allowed values: json, yaml, plain, table (default: table on a terminal, json "
                      "when piped or redirected)")
ARG_FORCE = Arg(("--force",), action="store_true",
                help="forget even with scheduled messages (purged) or dead letters (left in the error queue)")
ARG_TRANSPORT = Arg(("--transport",), default="sql", help="the transport of the error queue: sql, rabbitmq or sqs")
ARG_TRANSPORT_CONN = Arg(("--transport-conn-id",), help="the transport's connection (default: its kind's default)")
ARG_ERROR_QUEUE = Arg(("--error-queue",), default="error", help="the error queue (default: error)")
ARG_MAX_MESSAGES = Arg(("--max-messages",), type=int, help="redrive at most this many")
ARG_RATE = Arg(("--max-per-second",), type=float, help="redrive at most this many per second")
ARG_DRY_RUN = Arg(("--dry-run",), action="store_true",
                  help="only print the schema versions that would be applied; change nothing")

ARG_HISTORY_ID = Arg(("--id",), dest="message_id", metavar="MESSAGE_ID", help="only this message's entries")
ARG_OUTCOME = Arg(("--outcome",), choices=("delivered", "retried", "dead_lettered", "cancelled"),
                  help="only entries of this outcome")
ARG_SINCE = Arg(("--since",), help="handed over at or after this ISO time (with offset)")
ARG_BEFORE = Arg(("--before",), help="handed over before this ISO time (with offset)")
ARG_HISTORY_LIMIT = Arg(("--limit",), type=int, default=50, help="entries (1..1000, default 50)")
ARG_WINDOW = Arg(("--window",), choices=("1h", "6h", "24h"), default="1h", help="how far back (default 1h)")
ARG_STORY_ID = Arg(("message_id",), metavar="MESSAGE_ID", help="the message (the id a send returned)")
_STORE_ONLY = (ARG_CONN_ID, ARG_TABLE, ARG_DB_SCHEMA)
_STORE = (*_STORE_ONLY, ARG_OUTPUT)
_SELECT = (ARG_IDS, ARG_DESTINATION, ARG_HEADER)
_FILTER = (ARG_DUE_FROM, ARG_DUE_BEFORE, ARG_BODY_CONTAINS)
_BULK = (*_SELECT, *_FILTER, ARG_ACTION_DRY_RUN, ARG_ASSUME_YES)

COMMANDS = (
    ActionCommand(name="backlog", help="Counts per destination: scheduled, due, in flight, paused, histogram",
                  func=lazy_load_command(_COMMANDS + "backlog"), args=(*_STORE, ARG_DESTINATION)),
    ActionCommand(name="browse", help="List scheduled messages, soonest due first, without claiming them",
                  func=lazy_load_command(_COMMANDS + "browse"),
                  args=(*_STORE, *_SELECT, *_FILTER, ARG_LIMIT, ARG_AFTER, ARG_NO_BODIES)),
    ActionCommand(name="cancel", help="Cancel scheduled messages: by --id, or by a filter (--destination, --header, "
                  "--due-from/--due-before, --body-contains), counted first and changed in batches",
                  func=lazy_load_command(_COMMANDS + "cancel"), args=(*_STORE, *_BULK)),
    ActionCommand(name="reschedule", help="Move scheduled messages to --deliver-at or --delay-seconds from now "
                  "(selected as cancel selects them)", func=lazy_load_command(_COMMANDS + "reschedule"),
                  args=(*_STORE, *_BULK, ARG_DELIVER_AT, ARG_DELAY)),
    ActionCommand(name="edit", help="Change a scheduled message's body and/or headers (refused once it is taken for "
                  "delivery)", func=lazy_load_command(_COMMANDS + "edit"),
                  args=(*_STORE, ARG_EDIT_ID, ARG_BODY, ARG_SET_HEADER)),
    ActionCommand(name="run-now", help="Make scheduled messages due now (selected as cancel selects them)",
                  func=lazy_load_command(_COMMANDS + "run_now"), args=(*_STORE, *_BULK)),
    ActionCommand(name="pause-messages", help="Pause scheduled messages (selected as cancel selects them): stored, "
                  "never delivered until resume-messages", func=lazy_load_command(_COMMANDS + "pause_messages"),
                  args=(*_STORE, *_BULK)),
    ActionCommand(name="resume-messages", help="Resume paused messages (selected as cancel selects them): those past "
                  "due go at once", func=lazy_load_command(_COMMANDS + "resume_messages"), args=(*_STORE, *_BULK)),
    ActionCommand(name="pause", help="Pause destinations: their messages stay stored until resumed",
                  func=lazy_load_command(_COMMANDS + "pause"), args=(*_STORE, ARG_DESTINATIONS)),
    ActionCommand(name="resume", help="Resume paused destinations",
                  func=lazy_load_command(_COMMANDS + "resume"), args=(*_STORE, ARG_DESTINATIONS)),
    ActionCommand(name="purge", help="Remove every scheduled message of a destination (a dry run without --yes)",
                  func=lazy_load_command(_COMMANDS + "purge"),
                  args=(*_STORE, ARG_PURGE_DESTINATION, ARG_OLD_DESTINATION, ARG_YES)),
    ActionCommand(name="forget", help="Forget destinations (a mistyped name): refused while messages or dead letters "
                  "remain, unless --force", func=lazy_load_command(_COMMANDS + "forget"),
                  args=(*_STORE, ARG_DESTINATIONS, ARG_FORCE, ARG_TRANSPORT, ARG_TRANSPORT_CONN, ARG_ERROR_QUEUE)),
    ActionCommand(name="dead-letters", help="List the error queue's messages with their failure details, or "
                  "delete them (`dead-letters delete`: by --id, --destination or --all; a dry run without --yes)",
                  func=lazy_load_command(_COMMANDS + "dead_letters"),
                  args=(ARG_DEAD_LETTERS_ACTION, *_STORE, ARG_TRANSPORT, ARG_TRANSPORT_CONN, ARG_ERROR_QUEUE, ARG_IDS,
                        ARG_DESTINATION, ARG_LIMIT, ARG_ALL, ARG_DELETE_YES)),
    ActionCommand(name="redrive", help="Send dead letters back to their destinations through the store",
                  func=lazy_load_command(_COMMANDS + "redrive"),
                  args=(*_STORE, ARG_TRANSPORT, ARG_TRANSPORT_CONN, ARG_ERROR_QUEUE, ARG_IDS, ARG_DESTINATION,
                        ARG_MAX_MESSAGES, ARG_RATE)),
    ActionCommand(name="history", help="What became of messages (delivered, retried, dead-lettered, cancelled), "
                  "newest first, with their lateness and attempts", func=lazy_load_command(_COMMANDS + "history"),
                  args=(*_STORE, ARG_DESTINATION, ARG_HISTORY_ID, ARG_OUTCOME, ARG_SINCE, ARG_BEFORE,
                        ARG_HISTORY_LIMIT, ARG_AFTER)),
    ActionCommand(name="lateness", help="Per minute: messages delivered and their lateness p50/p99 (ms), retried, "
                  "dead-lettered and cancelled", func=lazy_load_command(_COMMANDS + "lateness"),
                  args=(*_STORE, ARG_DESTINATION, ARG_WINDOW)),
    ActionCommand(name="story", help="One message: where it is now and what became of each attempt",
                  func=lazy_load_command(_COMMANDS + "story"), args=(*_STORE, ARG_STORY_ID, ARG_NO_BODIES)),
    GroupCommand(name="db", help="The store's tables: create them, or bring them up to this release's version",
                 subcommands=(
                     ActionCommand(name="upgrade", help="Create the store's tables or upgrade them to this release's "
                                   "schema version (and the SQL-table queues' tables where they exist); prints the "
                                   "versions it applies", func=lazy_load_command(_COMMANDS + "db_upgrade"),
                                   args=(*_STORE_ONLY, ARG_DRY_RUN)),
                 )),
)


def get_delay_cli_commands() -> list[GroupCommand]:
    """The provider's `cli` entry: `airflow delayed-messages <command>`."""
    return [GroupCommand(name="delayed-messages", help="Operate the backlog of delayed messages",
                         subcommands=COMMANDS)]

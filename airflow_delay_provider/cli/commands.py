"""The `airflow delayed-messages` commands: parse the arguments, call the store hook, print JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any

from airflow.utils import cli as cli_utils
from airflow.utils.providers_configuration_loader import providers_configuration_loaded

from airflow_delay_provider.core.errors import DelayProviderError
from airflow_delay_provider.hooks.delay_store import DelayStoreHook
from airflow_delay_provider.hooks.transport import transport_hook, transport_options
from airflow_delay_provider.stores.engine import safe_url


def _command(func: Callable[[DelayStoreHook, argparse.Namespace], dict | str],
             as_json: bool = True) -> Callable[[argparse.Namespace], None]:
    """Run one command: the hook from --conn-id/--table/--db-schema, the report as JSON (or text) on stdout, and
    a refused input or a store not reachable or not there as one line on stderr with exit status 1."""

    @wraps(func)
    @cli_utils.action_cli
    @providers_configuration_loaded
    def run(args: argparse.Namespace) -> None:
        hook = DelayStoreHook(args.conn_id, table=args.table, db_schema=args.db_schema)
        try:
            report = func(hook, args)
        except DelayProviderError as exc:
            raise SystemExit(f"error: {exc}") from None
        try:
            print(json.dumps(report, indent=2, default=str) if as_json else report, flush=True)
        except BrokenPipeError:
            # The reader stopped early (`... | head`), which is not an error. Python would report the failed
            # flush of stdout at exit, so stdout goes to /dev/null first.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())

    return run


def _ids(args: argparse.Namespace) -> list[str] | None:
    ids = [part.strip() for value in args.message_ids or () for part in value.split(",") if part.strip()]
    return ids or None


def _selector(args: argparse.Namespace) -> dict[str, Any]:
    headers = {}
    for pair in args.headers or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"error: --header takes KEY=VALUE, got {pair!r}")
        headers[key] = value
    return {"message_ids": _ids(args), "destination": args.destination, "headers": headers or None}


def _transport(hook: DelayStoreHook, args: argparse.Namespace) -> Any:
    return transport_hook(args.transport, args.transport_conn_id, hook, args.db_schema).get_transport(
        **transport_options(args.transport, {}))


@_command
def backlog(hook: DelayStoreHook, args: argparse.Namespace) -> dict:
    return hook.backlog(args.destination)


@_command
def browse(hook: DelayStoreHook, args: argparse.Namespace) -> dict:
    return hook.browse(**_selector(args), due_from=args.due_from, due_before=args.due_before, limit=args.limit,
                       after=args.after, show_bodies=not args.no_bodies)


@_command
def cancel(hook: DelayStoreHook, args: argparse.Namespace) -> dict:
    return hook.cancel(**_selector(args))


@_command
def reschedule(hook: DelayStoreHook, args: argparse.Namespace) -> dict:
    return hook.reschedule(**_selector(args), deliver_at=args.deliver_at, delay_seconds=args.delay_seconds)


@_command
def run_now(hook: DelayStoreHook, args: argparse.Namespace) -> dict:
    return hook.run_now(**_selector(args))


@_command
def pause(hook: DelayStoreHook, args: argparse.Namespace) -> dict:
    return hook.pause(args.destinations)


@_command
def resume(hook: DelayStoreHook, args: argparse.Namespace) -> dict:
    return hook.resume(args.destinations)


@_command
def purge(hook: DelayStoreHook, args: argparse.Namespace) -> dict:
    return hook.purge(args.destination, dry_run=not args.yes)


@_command
def forget(hook: DelayStoreHook, args: argparse.Namespace) -> dict:
    transport = _transport(hook, args)
    try:
        return hook.forget(args.destinations, force=args.force, transport=transport, error_queue=args.error_queue)
    finally:
        transport.close()


@_command
def dead_letters(hook: DelayStoreHook, args: argparse.Namespace) -> dict:
    transport = _transport(hook, args)
    try:
        return hook.dead_letters(transport, error_queue=args.error_queue, destination=args.destination,
                                 message_ids=_ids(args), limit=args.limit)
    finally:
        transport.close()


@_command
def redrive(hook: DelayStoreHook, args: argparse.Namespace) -> dict:
    transport = _transport(hook, args)
    try:
        return hook.redrive(transport, error_queue=args.error_queue, destination=args.destination,
                            message_ids=_ids(args), max_messages=args.max_messages,
                            max_per_second=args.max_per_second)
    finally:
        transport.close()


def _upgrade(hook: DelayStoreHook, args: argparse.Namespace) -> str:
    """What `airflow delayed-messages db upgrade` prints, worded as `airflow db migrate`: the database, then per set
    of tables where it stands, the versions to apply, and what was applied (nothing with --dry-run)."""
    lines = [f"DB: {safe_url(hook.url)}"]
    for part in hook.upgrade(dry_run=args.dry_run):
        if not part["exists"] and not part["pending"]:
            lines.append(f"{part['what']}: no tables (provisioning its queues creates them)")
            continue
        at = f"schema version {part['version']}" + ("" if part["exists"] else " (no tables yet)")
        if not part["pending"]:
            lines.append(f"{part['what']}: {at}, this release's is {part['latest']}: up to date")
            continue
        lines.append(f"{part['what']}: {at}; this release's is {part['latest']}")
        lines.append("Versions to apply:")
        lines.extend(f"  {version} {name}" for version, name in part["pending"])
        if part["applied"]:
            lines.append(f"Applied {', '.join(map(str, part['applied']))}: now at schema version {part['latest']}.")
    if args.dry_run:
        lines.append("Dry run: nothing was applied.")
    return "\n".join(lines)


db_upgrade = _command(_upgrade, as_json=False)

"""The `airflow delayed-messages` commands: parse the arguments, call the store hook, print the report."""

from __future__ import annotations

import argparse
import getpass
import os
import re
import shlex
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any, NoReturn

from airflow.utils import cli as cli_utils
from airflow.utils.providers_configuration_loader import providers_configuration_loaded

from airflow_delay_provider import audit
from airflow_delay_provider.cli.output import default_output, render
from airflow_delay_provider.core.backlog import CONFIRM_ABOVE
from airflow_delay_provider.core.errors import DelayProviderError
from airflow_delay_provider.hooks.delay_store import DelayStoreHook
from airflow_delay_provider.hooks.transport import transport_hook, transport_options
from airflow_delay_provider.stores.engine import safe_url

#: The hook's words for what a user gave, as the command line's flags. The hook speaks to operators and the page
#: too, so its errors name parameters; a command-line user sees the flags instead.
_FLAGS = (
    (r"select messages by message_ids, destination, headers \(e\.g\. \{'order-id': '42'\}\), body_contains or a "
     r"due window \(due_from, due_before\)",
     "select messages with --id, --destination, --header KEY=VALUE, --body-contains or a due window (--due-from, "
     "--due-before)"),
    (r"select the dead letters to delete by message_ids and/or destination, or all of them with everything=True",
     "select the dead letters to delete with --id and/or --destination, or all of them with --all"),
    (r"headers \(the header match\)", "--header"),
    (r"\bdelay_seconds=0\b", "--delay-seconds 0"),
    (r"\bmessage_ids\b", "--id"),
    (r"\bdeliver_at\b", "--deliver-at"),
    (r"\bdelay_seconds\b", "--delay-seconds"),
    (r"\bdue_from\b", "--due-from"),
    (r"\bdue_before\b", "--due-before"),
    (r"\bbody_contains\b", "--body-contains"),
    (r"\bmax_messages\b", "--max-messages"),
    (r"\bmax_per_second\b", "--max-per-second"),
    (r"^(limit|after) (must)", r"--\1 \2"),
)


def flag_message(message: str) -> str:
    """A hook's error as a command-line user reads it: the flags in place of the parameters."""
    for pattern, flag in _FLAGS:
        message = re.sub(pattern, flag, message)
    return message


def _command(func: Callable[[DelayStoreHook, argparse.Namespace], dict | str], items: str | None = None,
             item_name: str = "name", hide: tuple[str, ...] = (),
             note: Callable[[dict], str | None] | None = None,
             action: str | Callable[[argparse.Namespace], str | None] | None = None,
             ) -> Callable[[argparse.Namespace], None]:
    """Run one command: the hook from --conn-id/--table/--db-schema, the report on stdout in --output's format
    (`items`, `item_name`, `hide`: see output.render; text as it is) followed by what `note` says of it on stderr
    (where a program reading stdout does not get it), and a refused input or a store not reachable or not there as
    one line on stderr with exit status 1. A command that changes messages (`action`, or what it gives for the
    command line: None when that one changes nothing) is recorded, once done, in Airflow's audit log with its counts
    (airflow_delay_provider.audit)."""

    @wraps(func)
    @cli_utils.action_cli
    @providers_configuration_loaded
    def run(args: argparse.Namespace) -> None:
        hook = DelayStoreHook(args.conn_id, table=args.table, db_schema=args.db_schema)
        try:
            report = func(hook, args)
        except (DelayProviderError, NotImplementedError) as exc:  # a transport that cannot do it says why
            raise SystemExit(f"error: {flag_message(str(exc))}") from None
        name = action(args) if callable(action) else action
        if name is not None and isinstance(report, dict):
            # The OS user, as Airflow's own record of a command line names it.
            audit.record(name, getpass.getuser(), "cli", hook.delay_store_conn_id, _request(args), report)
        try:
            if isinstance(report, str):
                print(report, flush=True)
            else:
                render(report, getattr(args, "output", None) or default_output(), items, item_name, hide)
                said = note(report) if note else None
                if said:
                    print(said, file=sys.stderr, flush=True)
        except BrokenPipeError:
            # The reader stopped early (`... | head`), which is not an error. Python would report the failed
            # flush of stdout at exit, so stdout goes to /dev/null first.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())

    return run


def _refuse(message: str) -> NoReturn:
    """A command line that cannot be run as given: one line on stderr, exit status 1."""
    raise SystemExit(f"error: {message}")


def _request(args: argparse.Namespace) -> dict[str, Any]:
    """What a command was asked to act on, as the audit log records it."""
    request = {k: v for k, v in vars(args).items() if k in ("message_id", "destination", "destinations", "deliver_at",
                                                           "delay_seconds", "force", "error_queue")}
    if hasattr(args, "headers"):
        request.update({k: v for k, v in _selector(args).items() if v})
    elif getattr(args, "message_ids", None):
        request["message_ids"] = _ids(args)
    if getattr(args, "all", False):
        request["everything"] = True
    return request


def _action(name: str) -> Callable[[Callable[[DelayStoreHook, argparse.Namespace], dict]],
                                   Callable[[argparse.Namespace], None]]:
    """_command as a decorator, for a command that changes messages (recorded in the audit log as `name`)."""
    return lambda func: _command(func, action=name)


def _command_of(items: str, item_name: str, hide: tuple[str, ...] = ()) -> Callable[
        [Callable[[DelayStoreHook, argparse.Namespace], dict]], Callable[[argparse.Namespace], None]]:
    """_command as a decorator, for a report whose `items` are the table's rows."""
    return lambda func: _command(func, items, item_name, hide)


def _ids(args: argparse.Namespace) -> list[str] | None:
    ids = [part.strip() for value in args.message_ids or () for part in value.split(",") if part.strip()]
    return ids or None


def _selector(args: argparse.Namespace) -> dict[str, Any]:
    headers = {}
    for pair in args.headers or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            _refuse(f"--header takes KEY=VALUE, got {pair!r}")
        headers[key] = value
    return {"message_ids": _ids(args), "destination": args.destination, "headers": headers or None,
            **{k: getattr(args, k) for k in ("due_from", "due_before", "body_contains") if getattr(args, k, None)}}


def _transport(hook: DelayStoreHook, args: argparse.Namespace) -> Any:
    return transport_hook(args.transport, args.transport_conn_id, hook, args.db_schema).get_transport(
        **transport_options(args.transport, {}))


@_command_of("destinations", "destination", hide=("buckets",))  # the page's labels of the histogram
def backlog(hook: DelayStoreHook, args: argparse.Namespace) -> dict:
    return hook.backlog(args.destination)


@_command_of("messages", "message_id")
def browse(hook: DelayStoreHook, args: argparse.Namespace) -> dict:
    return hook.browse(**_selector(args), limit=args.limit, after=args.after, show_bodies=not args.no_bodies)


@_command_of("entries", "message_id")
def history(hook: DelayStoreHook, args: argparse.Namespace) -> dict:
    return hook.history(destination=args.destination, message_id=args.message_id, outcome=args.outcome,
                        since=args.since, before=args.before, limit=args.limit, after=args.after)


@_command_of("minutes", "minute")
def lateness(hook: DelayStoreHook, args: argparse.Namespace) -> dict:
    return hook.history_chart(destination=args.destination, window=args.window)


@_command_of("history", "handed_at")
def story(hook: DelayStoreHook, args: argparse.Namespace) -> dict:
    return hook.story(args.message_id, show_bodies=not args.no_bodies)


#: A change's call of the hook: (hook, the command's arguments, the selection, dry_run) -> its report.
_Change = Callable[[DelayStoreHook, argparse.Namespace, dict[str, Any], bool], dict]


def _bulk(verb: str, change: _Change) -> Callable[[DelayStoreHook, argparse.Namespace], dict]:
    """A cancel, reschedule or run-now: by --id at once; by a filter counted first, and above CONFIRM_ABOVE asked
    (on a terminal) or refused (elsewhere) without --yes, as `airflow tasks clear` asks. --dry-run only counts."""

    def run(hook: DelayStoreHook, args: argparse.Namespace) -> dict:
        selection = _selector(args)
        if args.dry_run or selection["message_ids"] is None:
            counted = change(hook, args, selection, True)
            if args.dry_run:
                return counted
            n = _would(counted)
            if counted["confirm"] and not args.yes:
                question = f"{verb} {n:,} scheduled messages ({_described(counted['selector'])})?"
                if not sys.stdin.isatty():
                    _refuse(f"{question} More than {CONFIRM_ABOVE:,}: run it again with --yes to confirm (or "
                            "--dry-run to count only)")
                if input(f"{question} [y/N] ").strip().lower() not in ("y", "yes"):
                    _refuse("nothing was changed")
        return change(hook, args, selection, False)

    return run


def _would(counted: dict) -> int:
    """What a count (a dry run) says the change would touch: its `would_cancel`, `would_pause`, ..."""
    return next(v for k, v in counted.items() if k.startswith("would_"))


def _described(selector: dict[str, Any]) -> str:
    return ", ".join(f"{k.replace('_', '-')} {v}" for k, v in selector.items())


def _count_note(report: dict) -> str | None:
    """After a --dry-run of a cancel, reschedule, run-now, pause or resume: what it counted, and how to do it."""
    if not report.get("dry_run"):
        return None
    n = _would(report)
    again = shlex.join(arg for arg in sys.argv[1:] if arg != "--dry-run")
    held = f"; {report['in_flight']} held by a running sweep would stay" if report["in_flight"] else ""
    return f"Dry run: nothing was changed; {n} scheduled message(s) would be{held}. To do it: airflow {again}"


def _action_unless_dry(name: str) -> Callable[[argparse.Namespace], str | None]:
    return lambda args: None if args.dry_run else name


cancel = _command(_bulk("Cancel", lambda hook, _, selection, dry_run: hook.cancel(**selection, dry_run=dry_run)),
                  note=_count_note, action=_action_unless_dry("cancel"))
reschedule = _command(_bulk("Reschedule", lambda hook, args, selection, dry_run: hook.reschedule(
    **selection, deliver_at=args.deliver_at, delay_seconds=args.delay_seconds, dry_run=dry_run)),
    note=_count_note, action=_action_unless_dry("reschedule"))
run_now = _command(_bulk("Run now", lambda hook, _, selection, dry_run: hook.run_now(**selection, dry_run=dry_run)),
                   note=_count_note, action=_action_unless_dry("run_now"))
pause_messages = _command(_bulk("Pause", lambda hook, _, selection, dry_run: hook.pause_messages(
    **selection, dry_run=dry_run)), note=_count_note, action=_action_unless_dry("pause_messages"))
resume_messages = _command(_bulk("Resume", lambda hook, _, selection, dry_run: hook.resume_messages(
    **selection, dry_run=dry_run)), note=_count_note, action=_action_unless_dry("resume_messages"))


@_action("edit")
def edit(hook: DelayStoreHook, args: argparse.Namespace) -> dict:
    headers = None
    if args.set_headers is not None:
        headers = {}
        for pair in args.set_headers:
            key, sep, value = pair.partition("=")
            if not sep:
                _refuse(f"--set-header takes KEY=VALUE, got {pair!r}")
            headers[key] = value
    return hook.edit(message_id=args.message_id, body=args.body, headers=headers)


@_action("pause")
def pause(hook: DelayStoreHook, args: argparse.Namespace) -> dict:
    return hook.pause(args.destinations)


@_action("resume")
def resume(hook: DelayStoreHook, args: argparse.Namespace) -> dict:
    return hook.resume(args.destinations)


def _purge(hook: DelayStoreHook, args: argparse.Namespace) -> dict:
    destination = args.destination
    if args.old_destination is not None:
        if destination is not None and destination != args.old_destination:
            _refuse(f"two destinations given ({args.old_destination!r} and --destination {destination!r}): "
                    "give one, with --destination")
        destination = args.old_destination
        print(f"warning: `purge DESTINATION` is deprecated: write `purge --destination {destination}`",
              file=sys.stderr, flush=True)
    if destination is None:
        _refuse("purge needs --destination DESTINATION (the destination whose scheduled messages go)")
    return hook.purge(destination, dry_run=not args.yes)


@_action("forget")
def forget(hook: DelayStoreHook, args: argparse.Namespace) -> dict:
    transport = _transport(hook, args)
    try:
        return hook.forget(args.destinations, force=args.force, transport=transport, error_queue=args.error_queue)
    finally:
        transport.close()


def _dead_letters(hook: DelayStoreHook, args: argparse.Namespace) -> dict:
    """`dead-letters [list]` lists them; `dead-letters delete` deletes them (a dry run without --yes)."""
    if args.action == "delete":
        return _delete_dead_letters(hook, args)
    if args.all or args.yes:
        _refuse(f"{'--all' if args.all else '--yes'} is for `dead-letters delete`; a listing changes nothing")
    transport = _transport(hook, args)
    try:
        return hook.dead_letters(transport, error_queue=args.error_queue, destination=args.destination,
                                 message_ids=_ids(args), limit=args.limit)
    finally:
        transport.close()


def _delete_dead_letters(hook: DelayStoreHook, args: argparse.Namespace) -> dict:
    ids = _ids(args)
    if args.all and (ids or args.destination):
        _refuse("--all deletes every dead letter of the error queue: give it without --id and --destination")
    if not (args.all or ids or args.destination):
        _refuse("select the dead letters to delete with --id and/or --destination, or all of them with --all")
    transport = _transport(hook, args)
    try:
        return hook.delete_dead_letters(transport, error_queue=args.error_queue, destination=args.destination,
                                        message_ids=ids, everything=args.all, dry_run=not args.yes)
    finally:
        transport.close()


def _confirm(report: dict) -> str | None:
    """After a dry run (a purge's, a deletion's): how to do what it counted."""
    if not report.get("dry_run"):
        return None
    again = shlex.join(arg for arg in sys.argv[1:] if arg != "--yes")
    if "would_purge" in report:
        return (f"Dry run: nothing was purged; {report['would_purge']} scheduled message(s) would be. To purge them: "
                f"airflow {again} --yes")
    more = " (or more: only the first part of the queue was looked at)" if report["more"] else ""
    return (f"Dry run: nothing was deleted; {report['would_delete']} dead letter(s){more} would be. To delete them: "
            f"airflow {again} --yes")


# Only `dead-letters delete` changes anything: a listing is not an action.
dead_letters = _command(_dead_letters, items="dead_letters", item_name="message_id", note=_confirm,
                        action=lambda args: "delete_dead_letters" if args.action == "delete" else None)
purge = _command(_purge, note=_confirm, action="purge")


@_action("redrive")
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


db_upgrade = _command(_upgrade)

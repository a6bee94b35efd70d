"""What the provider's command definitions cost every `airflow` invocation: Airflow imports them (through the provider
info's `cli` entry) to build its parser, whatever command runs, so they import nothing beyond Airflow's own CLI
classes; a command's code is imported when it runs. bench/bench_cli_help.py measures the time; this keeps the
reason for it."""

from __future__ import annotations

import json
import subprocess
import sys

# What Airflow's parser has imported anyway, then what ours adds.
PROBE = """
import json, sys
import airflow.cli.cli_config
before = set(sys.modules)
from airflow_delay_provider.get_provider_info import get_provider_info
from airflow_delay_provider.cli.definition import get_delay_cli_commands
get_delay_cli_commands()
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_the_command_definitions_import_nothing_but_themselves():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, check=True)
    added = json.loads(done.stdout.splitlines()[-1])
    assert set(added) <= {"airflow_delay_provider.get_provider_info", "airflow_delay_provider.cli",
                          "airflow_delay_provider.cli.definition"}, added


def test_every_command_is_loaded_lazily_from_the_commands_module():
    from airflow.cli.cli_config import ActionCommand, GroupCommand

    from airflow_delay_provider.cli import commands
    from airflow_delay_provider.cli.definition import get_delay_cli_commands

    def actions(command):
        if isinstance(command, GroupCommand):
            for sub in command.subcommands:
                yield from actions(sub)
        else:
            assert isinstance(command, ActionCommand)
            yield command

    found = list(actions(get_delay_cli_commands()[0]))
    assert len(found) == 18
    for command in found:
        # lazy_load_command's wrapper, holding the path it imports when the command runs, which exists.
        assert command.func.__module__ == "airflow.cli.cli_config", command.name
        [target] = [cell.cell_contents for cell in command.func.__closure__]
        assert target.startswith("airflow_delay_provider.cli.commands.")
        assert callable(getattr(commands, target.rsplit(".", 1)[1])), target

"""Benchmark: the CPU time of `airflow delayed-messages --help` beside Airflow's own `airflow dags --help`.

Both start the same `airflow` program, which loads every provider's CLI commands (ours through the provider
info's `cli` entry) before it parses anything; the difference is what our commands cost a user at every
`airflow` invocation and at each of ours. Runs the commands in turns (so a change in the machine's load falls on
both), N times each, and prints the medians of their CPU time (user + system, read with
resource.getrusage(RUSAGE_CHILDREN) around each run) and the difference. Not a test: a figure for a note.

    python bench/bench_cli_help.py              # 7 runs of each
    python bench/bench_cli_help.py -n 15 --subcommand browse
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from machine import describe, machine  # noqa: E402


def cpu_seconds(command: list[str], env: dict[str, str]) -> float:
    """The CPU time (user + system) of one run of `command` and its children."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=7, help="runs of each command (default 7)")
    parser.add_argument("--subcommand", default=None,
                        help="time `airflow delayed-messages SUBCOMMAND --help` instead of the group's help")
    args = parser.parse_args()
    airflow = str(Path(sys.executable).parent / "airflow")
    ours = [airflow, "delayed-messages", *([args.subcommand] if args.subcommand else []), "--help"]
    theirs = [airflow, "dags", "--help"]
    info = machine()  # its load average: at the start
    with tempfile.TemporaryDirectory() as home:
        # A home of its own, as a user's: the config is written by the first run, which is not counted.
        env = {**os.environ, "AIRFLOW_HOME": home, "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
        for command in (theirs, ours):
            cpu_seconds(command, env)
        times: dict[str, list[float]] = {"theirs": [], "ours": []}
        for _ in range(args.n):
            times["theirs"].append(cpu_seconds(theirs, env))
            times["ours"].append(cpu_seconds(ours, env))
    info["load_average_end"] = round(os.getloadavg()[0], 2)
    print(describe(info) + f"; load average {info['load_average_end']} at end")
    median = {k: statistics.median(v) for k, v in times.items()}
    width = max(len(" ".join(ours[1:])), len(" ".join(theirs[1:])))
    print(f"{'command':<{width + 7}}  median CPU s  (min..max of {args.n})")
    for key, command in (("theirs", theirs), ("ours", ours)):
        print(f"airflow {' '.join(command[1:]):<{width}}  {median[key]:12.2f}  "
              f"({min(times[key]):.2f}..{max(times[key]):.2f})")
    print(f"difference (ours - theirs): {median['ours'] - median['theirs']:+.2f} s of CPU")


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# make test-compat-<version>: the built wheel (not editable) in a venv of that Airflow version's own, from its committed
# constraints (constraints.txt is Airflow 3.3.2's, constraints-airflow-<version>.txt the others': 3.2 for 3.2.2, 3.3.0
# for the oldest 3.3), `pip check` and `airflow providers list`, then the fast tier, the store and transport contracts
# (PostgreSQL, RabbitMQ, moto) and the deployment smoke test against it. The venv is made again whenever the wheel or
# the constraints are newer.
set -euo pipefail
minor=$1
cd "$(dirname "$0")/.."
constraints=constraints-airflow-$minor.txt
[ "$minor" = 3.3 ] && constraints=constraints.txt
[ -f "$constraints" ] || { echo "no constraints for Airflow $minor ($constraints)"; exit 2; }
venv=.venv-airflow-$minor
wheel=$(ls dist/airflow_delay_provider-*.whl)
started=$(date +%s)
if [ ! -f "$venv/.installed" ] || [ "$constraints" -nt "$venv/.installed" ] || [ "$wheel" -nt "$venv/.installed" ]; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --upgrade pip
    "$venv/bin/pip" install --quiet -c "$constraints" "$wheel[all,test]"
    # The Spark provider's pyspark-client writes into pyspark/: reinstall pyspark last so it is whole.
    "$venv/bin/pip" install --quiet --no-deps --force-reinstall -c "$constraints" pyspark
    "$venv/bin/pip" check
    touch "$venv/.installed"
fi
installed=$(date +%s)
version=$("$venv/bin/python" -c "import airflow; print(airflow.__version__)")
echo "Airflow $version in $venv ($((installed - started)) s to install)"
case "$version" in "$minor" | "$minor".*) ;; *) echo "expected Airflow $minor(.x), found $version"; exit 1;; esac
# Without the AIRFLOW_HOME of `make` (tests/conftest.py gives each run a home of its own).
unset AIRFLOW_HOME
# Airflow finds the installed wheel through its entry point (the deployment smoke test's processes run it too).
AIRFLOW_HOME=$(mktemp -d) "$venv/bin/airflow" providers list -o plain 2>/dev/null \
    | awk '$1 == "airflow-delay-provider" {print "airflow providers list:", $1, $NF; found = 1} END {exit !found}'
"$venv/bin/python" -m pytest -p no:cacheprovider -q -n 2 -m "not services" tests
"$venv/bin/python" -m pytest -p no:cacheprovider -q -n 2 tests/contract
"$venv/bin/python" -m pytest -p no:cacheprovider -q tests/deployment/test_smoke.py
echo "Airflow $version: the fast tier, the contracts and the smoke test passed in $(( $(date +%s) - started )) s"

# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
JDBC_JAR := /usr/share/java/postgresql.jar
CHROMIUM := /usr/bin/chromium
export AIRFLOW_HOME := $(CURDIR)/.airflow

.PHONY: demo test test-fast test-deep test-compat bench bench-on-url install clean dist docs check-wheel

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[all,test,docs]'
	@# The Spark provider's pyspark-client writes into pyspark/; reinstall pyspark last so it is whole.
	$(BIN)/pip install --quiet --no-deps --force-reinstall -c constraints.txt pyspark
	@# The editable build's leftover metadata: on sys.path from the checkout (python -m pytest) it would
	@# register the provider's entry points a second time.
	rm -rf airflow_delay_provider.egg-info
	touch $(STAMP)

# Spark reads a PostgreSQL store through this jar: Debian's, since nothing may be downloaded at run time.
$(JDBC_JAR):
	apt-get install -y -q libpostgresql-jdbc-java || (apt-get update -q && apt-get install -y -q libpostgresql-jdbc-java)

# The browser test drives Debian's chromium with Playwright (Playwright's own browser download is unreachable).
$(CHROMIUM):
	apt-get install -y -q chromium || (apt-get update -q && apt-get install -y -q chromium)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python scripts/demo.py

# Four workers on two cores: the suite waits on Airflow's loops, Spark's JVMs and brokers more than it computes (three
# left a third of the CPU idle once the docs and the Airflow 3.2 run beside it were done).
TEST_WORKERS ?= 4

test: $(STAMP) $(JDBC_JAR) $(CHROMIUM) dist
	$(BIN)/ruff check .
	$(BIN)/mypy
	@# Beside the suite: the docs (make docs) into dist/docs.log, and the lowest supported Airflow minor's
	@# compatibility run (make test-compat-3.2) into dist/compat.log; the suite, smoke test included, is the
	@# highest's (3.3). Any of the three failing fails the target.
	$(MAKE) --no-print-directory docs > dist/docs.log 2>&1 & docs=$$!; \
	scripts/test_compat.sh 3.2 > dist/compat.log 2>&1 & compat=$$!; \
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=15; suite=$$?; \
	wait $$docs; built=$$?; wait $$compat; compatible=$$?; \
	cat dist/docs.log; grep -v "^WARNING: Location" dist/compat.log | tail -n 40; \
	echo "suite: exit $$suite, docs: exit $$built, Airflow 3.2: exit $$compatible"; \
	test $$suite -eq 0 -a $$built -eq 0 -a $$compatible -eq 0

# The supported Airflow versions other than the suite's 3.3.2 (constraints.txt), lowest first, each in a venv of its own
# from its committed constraints (the wheel, not editable): 3.2 (3.2.2) and 3.3.0, the oldest 3.3. The fast tier,
# the contracts and the deployment smoke test (scripts/test_compat.sh); `make test-compat-3.3` runs 3.3.2 that way.
COMPAT_MINORS := 3.2 3.3.0
test-compat: dist
	for minor in $(COMPAT_MINORS); do scripts/test_compat.sh $$minor || exit 1; done

test-compat-%: dist
	scripts/test_compat.sh $*

# The wheel installed (not editable) into a fresh venv with constraints.txt: pip check, airflow providers list and
# the demo DAG from it. Minutes of pip: beside `make test` it took the suite past CI's 20 minutes, so it is its own.
check-wheel: dist
	$(BIN)/python scripts/check_wheel.py

# The sdist and the wheel a release uploads, checked as PyPI reads them (the test suite installs a fresh build).
dist: $(STAMP)
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	@# The sdist's egg-info, on sys.path from the checkout, would register the entry points a second time.
	rm -rf airflow_delay_provider.egg-info
	$(BIN)/twine check --strict dist/*

# The reference from the docstrings and the pages, warnings as errors; then every declared hook, operator, sensor
# and trigger must have its entry and every link between the pages must lead somewhere (scripts/check_docs.py).
docs: $(STAMP)
	$(BIN)/sphinx-build -q -E -W --keep-going -b html docs docs/_build/html
	$(BIN)/python scripts/check_docs.py

# The stateful test of every store against the model of what a store promises (tests/store_model.py) with many more
# examples than `make test` runs: STORE_MODEL_EXAMPLES of each (2,000 by default: about half an hour).
STORE_MODEL_EXAMPLES ?= 2000
test-deep: $(STAMP)
	STORE_MODEL_EXAMPLES=$(STORE_MODEL_EXAMPLES) $(BIN)/python -m pytest -q tests/integration/test_store_model.py

# No services needed: unit and property tests, and the contract tests on the in-memory fakes and SQLite.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not services" -q

# The benchmarks run on a throwaway PostgreSQL cluster with the installed server's shipped settings (initdb in a
# temporary directory, removed at the end); `make bench PG_URL=postgresql+psycopg://...` names a server instead.
PG_URL ?=
bench: $(STAMP) $(JDBC_JAR)
	$(BIN)/pip install --quiet -c constraints.txt matplotlib
	$(BIN)/python bench/pgserver.py $(if $(PG_URL),--pg-url $(PG_URL)) -- $(MAKE) --no-print-directory bench-on-url

bench-on-url:
	$(BIN)/python bench/bench_store.py --plot docs/bench_store.png
	$(BIN)/python bench/bench_rabbitmq.py
	$(BIN)/python bench/bench_throughput.py --plot docs/bench_throughput.png
	$(BIN)/python bench/bench_throughput.py --history-ab 10 --json bench/results/history.json --plot docs/bench_history.png
	$(BIN)/python bench/bench_scale.py --plot docs/bench_scale.png
	$(BIN)/python bench/bench_soak.py --minutes 3 --prefill 200000
	$(BIN)/python bench/bench_bulk.py --plot docs/bench_bulk.png
	$(BIN)/python bench/bench_later_start.py
	$(BIN)/python bench/bench_dispatchers.py
	$(BIN)/python bench/profile_pump.py --plot docs/profile_pump.png
	$(BIN)/python bench/bench_sqs.py
	$(BIN)/python bench/bench_spark.py
	$(BIN)/python bench/bench_deployment.py
	$(BIN)/python bench/bench_faults.py

clean:
	rm -rf $(VENV) .venv-airflow-* .airflow dist build docs/_build

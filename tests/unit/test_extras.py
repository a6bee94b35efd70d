"""Without the [amazon], [spark] and [messaging] extras the core package works and their features say which extra
to install.

A child Python in which boto3, botocore, PySpark and the amazon, Spark and common messaging providers cannot be
imported (a
sys.meta_path finder refuses them, as if they were not installed) imports every module of the package, reads the
provider info through Airflow's providers manager, builds Airflow's CLI with our commands and parses the example
DAGs. `make check-wheel` does the same in a fresh venv where they are not installed at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from airflow_delay_provider.compat import shared_stream
from tests.conftest import ROOT

BLOCKER = textwrap.dedent("""
    import sys
    BLOCKED = ("boto3", "botocore", "aiobotocore", "s3transfer", "pyspark", "airflow.providers.amazon",
               "airflow.providers.apache.spark", "airflow.providers.common.messaging")

    class NotInstalled:
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())

    # Their distributions too, before Airflow reads them: it would load the providers' info from their entry points.
    import importlib.metadata, importlib_metadata
    HIDDEN = {"apache-airflow-providers-amazon", "apache-airflow-providers-apache-spark", "boto3", "botocore",
              "pyspark", "pyspark-client", "apache-airflow-providers-common-messaging"}
    for module in (importlib.metadata, importlib_metadata):
        def distributions(everything=module.distributions, **kwargs):
            return (d for d in everything(**kwargs) if (d.metadata["name"] or "").lower() not in HIDDEN)
        module.distributions = distributions
""")

#: The modules of the extras' features, and the extra each names.
NEEDS_EXTRA = {
    "airflow_delay_provider.hooks.sqs": "amazon",
    "airflow_delay_provider.operators.sqs": "amazon",
    "airflow_delay_provider.triggers.sqs": "amazon",
    "airflow_delay_provider.operators.sweep": "spark",
    "airflow_delay_provider.queues.delay": "messaging",
}

CHILD = BLOCKER + textwrap.dedent("""
    import importlib, json, pkgutil, warnings
    from pathlib import Path
    warnings.simplefilter("ignore")
    import airflow_delay_provider
    from airflow_delay_provider.core.errors import MissingExtraError
    from airflow.exceptions import AirflowOptionalProviderFeatureException

    report = {"imported": [], "refused": {}, "other": {}}
    for module in pkgutil.walk_packages(airflow_delay_provider.__path__, "airflow_delay_provider."):
        try:
            importlib.import_module(module.name)
            report["imported"].append(module.name)
        except MissingExtraError as error:
            report["refused"][module.name] = [str(error), isinstance(error, AirflowOptionalProviderFeatureException)]
        except Exception as error:
            report["other"][module.name] = repr(error)

    from airflow.providers_manager import ProvidersManager
    manager = ProvidersManager()
    manager.initialize_providers_hooks()
    ours = manager.providers["airflow-delay-provider"]
    report["provider"] = ours.version
    report["connection_types"] = sorted(t for t, h in manager.hooks.items()
                                        if h and h.package_name == "airflow-delay-provider")
    report["triggers"] = sorted(t.trigger_class_name for t in manager.trigger
                                if t.package_name == "airflow-delay-provider")
    from airflow.cli.cli_parser import get_parser
    report["cli"] = "delayed-messages" in get_parser()._subparsers._group_actions[0].choices

    try:
        from airflow.dag_processing.dagbag import DagBag
    except ImportError:  # Airflow 3.2
        from airflow.models.dagbag import DagBag
    bag = DagBag(dag_folder=sys.argv[1])
    report["dags"] = sorted(bag.dag_ids)
    report["dag_errors"] = {Path(f).stem: e for f, e in bag.import_errors.items()}
    print("REPORT", json.dumps(report))
""")


def test_without_the_extras_the_core_imports_and_each_extra_feature_names_its_extra():
    done = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "dags")], capture_output=True, text=True,
                          cwd=ROOT, env=os.environ.copy(), timeout=300)
    line = next((x for x in done.stdout.splitlines() if x.startswith("REPORT ")), None)
    assert line, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(line.removeprefix("REPORT "))
    assert report["other"] == {}
    # The transports' SQS package refuses too (botocore), without Airflow's exception: a Spark executor has none.
    refused = {m: e for m, e in report["refused"].items() if not m.startswith("airflow_delay_provider.transports.sqs")}
    assert set(refused) == set(NEEDS_EXTRA)
    for module, (message, optional_feature) in refused.items():
        extra = NEEDS_EXTRA[module]
        assert f'pip install "airflow-delay-provider[{extra}]"' in message, message
        assert optional_feature, f"{module}: not Airflow's AirflowOptionalProviderFeatureException"
    assert "airflow_delay_provider.transports.sqs" in report["refused"]
    core = {"airflow_delay_provider.get_provider_info", "airflow_delay_provider.cli.definition",
            "airflow_delay_provider.cli.commands", "airflow_delay_provider.ui.plugin", "airflow_delay_provider.ui.app",
            "airflow_delay_provider.operators.delay", "airflow_delay_provider.operators.send",
            "airflow_delay_provider.operators.dispatch", "airflow_delay_provider.operators.provision",
            "airflow_delay_provider.hooks.delay_store", "airflow_delay_provider.hooks.rabbitmq",
            "airflow_delay_provider.triggers.delay_store", "airflow_delay_provider.stores.sql",
            "airflow_delay_provider.transports.sql", "airflow_delay_provider.transports.rabbitmq",
            "airflow_delay_provider.core.pump"}
    assert core <= set(report["imported"])
    # Airflow's providers manager lists the provider, its connection types and triggers; the CLI has our commands.
    assert report["provider"] == __import__("airflow_delay_provider").__version__
    assert report["connection_types"] == ["delay_store", "rabbitmq"]
    assert report["triggers"] == [f"airflow_delay_provider.triggers.{m}" for m in ("asset", "delay_store", "sqs")]
    assert report["cli"] is True
    # The example DAGs: only the SQS relay's and the Spark sweep's fail, each naming its extra (and on Airflow 3.2
    # the delayed DAG runs' two, which need 3.3: tests/integration/test_example_dags.py).
    needs_shared_streams = set() if shared_stream else {"delay_dag_run_scheduler", "delay_dag_run_target",
                                                        "delay_message_queue_target"}
    assert set(report["dag_errors"]) == {"delay_sqs_relay", "spark_bulk_sweep", "delay_message_queue_target"} | \
        needs_shared_streams, report["dag_errors"]
    assert '[amazon]"' in report["dag_errors"]["delay_sqs_relay"]
    assert '[spark]"' in report["dag_errors"]["spark_bulk_sweep"]
    assert '[messaging]"' in report["dag_errors"]["delay_message_queue_target"]
    assert {"demo_delayed_delivery", "delay_manual_send", "delay_provision_all"} <= set(report["dags"])

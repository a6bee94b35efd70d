"""docker-compose.yaml: valid against the compose specification (no Docker engine needed) and wired right."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_compose_file_is_valid_against_the_compose_spec():
    tool = Path(sys.executable).parent / "check-jsonschema"
    result = subprocess.run([str(tool), "--builtin-schema", "vendor.compose-spec", str(ROOT / "docker-compose.yaml")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_stack_has_every_part_and_preset_connections():
    compose = yaml.safe_load((ROOT / "docker-compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "rabbitmq", "moto", "spark-master", "spark-worker", "airflow-init", "airflow-apiserver",
            "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer"} <= set(services)
    scheduler = services["airflow-scheduler"]
    assert scheduler["depends_on"]["airflow-init"]["condition"] == "service_completed_successfully"
    conns = {k: json.loads(v) for k, v in scheduler["environment"].items() if k.startswith("AIRFLOW_CONN_")}
    assert {c["conn_type"] for c in conns.values()} == {"delay_store", "rabbitmq", "aws", "spark"}
    assert conns["AIRFLOW_CONN_AWS_DEFAULT"]["extra"]["endpoint_url"] == "http://moto:5000"
    assert all("healthcheck" in services[s] for s in ("postgres", "rabbitmq", "moto", "airflow-apiserver"))
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "FROM apache/airflow:3.3.2" in dockerfile and "pip install" in dockerfile


def test_every_airflow_container_shares_the_secrets_separate_homes_would_generate_apart():
    """Each container has its own AIRFLOW_HOME: without these set alike, the components generate their own
    and reject each other's task tokens (the deployment rig needs the same three)."""
    import base64

    from tests.deployment.rig import Deployment

    compose = yaml.safe_load((ROOT / "docker-compose.yaml").read_text())
    airflow = [s for s in compose["services"].values() if s.get("image", "").startswith("airflow-delay-provider")
               and "command" in s and not str(s["command"]).startswith("[")]
    assert {str(s["command"]) for s in airflow} >= {"api-server", "scheduler", "dag-processor", "triggerer"}
    rig_secrets = set(Deployment("/tmp/unused", ROOT / "dags").secrets)
    for service in airflow:
        env = service["environment"]
        assert rig_secrets <= set(env), rig_secrets - set(env)
        assert len(base64.urlsafe_b64decode(env["AIRFLOW__CORE__FERNET_KEY"])) == 32
        assert len(env["AIRFLOW__API_AUTH__JWT_SECRET"]) >= 64  # HS512
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC"].startswith("postgresql+psycopg://")

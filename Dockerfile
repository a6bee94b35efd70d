# Airflow 3.3.2 with this provider installed, for docker-compose.yaml.
FROM apache/airflow:3.3.2-python3.11
# spark-submit (from the pyspark wheel) needs Java; the bulk sweep reads PostgreSQL through Debian's JDBC jar.
USER root
RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless libpostgresql-jdbc-java \
 && rm -rf /var/lib/apt/lists/*
USER airflow
COPY --chown=airflow:root pyproject.toml README.md constraints.txt /opt/airflow-delay-provider/
COPY --chown=airflow:root airflow_delay_provider /opt/airflow-delay-provider/airflow_delay_provider
RUN pip install --no-cache-dir -c /opt/airflow-delay-provider/constraints.txt "/opt/airflow-delay-provider[all]"

"""The `airflow delayed-messages` command group."""

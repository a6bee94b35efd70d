"""The backlog page in Airflow's UI (Browse > Delayed messages): see `plugin` and `app`."""

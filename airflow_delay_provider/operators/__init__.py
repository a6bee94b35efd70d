"""Operators: provision, send, dispatch, migrate, the SQS relay, Spark sweeps, backlog actions, redrive and
delayed DAG runs."""

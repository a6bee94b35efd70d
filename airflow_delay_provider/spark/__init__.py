"""Bulk sweeps of due messages on Spark: `sweep` is the application, `sweep_app.py` the file spark-submit runs."""

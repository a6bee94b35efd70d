"""Durable, exact delayed delivery of messages for Apache Airflow."""

__version__ = "0.1.0"

"""This provider's schemes of Airflow's common message-queue trigger (`apache-airflow-providers-common-messaging`)."""

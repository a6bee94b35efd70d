"""The domain core: messages, delays, retry policies, the pump, settlement and the ports (no Airflow or broker
imports)."""

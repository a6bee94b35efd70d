"""A real Airflow deployment (api-server, scheduler, dag-processor, triggerer as separate processes) for tests
and benchmarks: see rig.py."""

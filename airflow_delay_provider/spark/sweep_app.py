"""The file spark-submit runs. The application lives in an importable module, so that Spark ships
its functions to the executors by reference rather than by value."""

import sys

from airflow_delay_provider.spark.sweep import main

if __name__ == "__main__":
    sys.exit(main())

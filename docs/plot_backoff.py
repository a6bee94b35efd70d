"""Draws docs/backoff_functions.png: the four backoff functions, 10 retries from 5 s to 260 s (as SNS documents them).

Run: .venv/bin/pip install matplotlib && .venv/bin/python docs/plot_backoff.py
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from airflow_delay_provider.core.retry_policy import BACKOFF_FUNCTIONS, DeliveryPolicy  # noqa: E402

fig, ax = plt.subplots(figsize=(7, 4))
for function in BACKOFF_FUNCTIONS:
    delays = DeliveryPolicy(5, 260, 10, backoff_function=function).retry_delays()
    ax.plot(range(1, 11), delays, marker="o", label=function)
ax.set_xlabel("retry")
ax.set_ylabel("delay before the retry (s)")
ax.set_title("Backoff phase: 10 retries from 5 s to 260 s")
ax.set_xticks(range(1, 11))
ax.legend()
ax.grid(alpha=0.3)
fig.tight_layout()
fig.savefig(Path(__file__).with_name("backoff_functions.png"), dpi=110)

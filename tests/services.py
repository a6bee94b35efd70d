"""Local stand-ins the tests and the benchmarks share: moto's server for SQS and S3, free loopback ports.

Plain Python (no pytest), so bench scripts import it as `tests.services` from the repo root.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """moto's server on a free loopback port: `url`, `reset()`, `stop()`; a context manager."""

    def __init__(self, timeout: float = 10.0) -> None:
        port = free_port()
        binary = Path(sys.executable).parent / "moto_server"
        if not binary.exists():
            raise RuntimeError(f"{binary} is missing: install the test extra (`make test` does)")
        self.url = f"http://127.0.0.1:{port}"
        self._proc = subprocess.Popen([str(binary), "-H", "127.0.0.1", "-p", str(port)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(self.url + "/moto-api/", timeout=0.5)
                return
            except OSError:
                if time.monotonic() > deadline or self._proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"moto_server did not start on port {port}") from None
                time.sleep(0.1)

    def reset(self) -> None:
        urllib.request.urlopen(urllib.request.Request(self.url + "/moto-api/reset", method="POST"), timeout=5)

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()

    def __enter__(self) -> MotoServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

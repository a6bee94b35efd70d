"""The local cluster's readiness check, against a web UI that is up but not yet answering with its state."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from airflow_delay_provider.spark.local_cluster import LocalCluster


def serving(bodies: list[bytes]):
    """A web UI on a free loopback port whose /json/ replies with each body in turn (the last one after)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the server's name for it
            body = bodies.pop(0) if len(bodies) > 1 else bodies[0]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("early", [b"", b"<html>starting</html>", b'{"workers": ['])
def test_a_reply_that_is_not_yet_the_state_counts_no_workers_and_the_next_one_counts(early):
    state = json.dumps({"workers": [{"state": "ALIVE"}, {"state": "DEAD"}, {"state": "ALIVE"}]}).encode()
    server = serving([early, state])
    cluster = LocalCluster(workers=2)
    try:
        cluster.ui_port = server.server_address[1]
        assert cluster.alive_workers() == 0
        assert cluster.alive_workers() == 2
    finally:
        server.shutdown()
        cluster.stop()

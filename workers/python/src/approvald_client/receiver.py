"""A small threaded HTTP endpoint for approvald's deliveries (standard library).

An application with a web framework mounts its own route instead and calls
``verify_delivery`` there; this is for workers that have none.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .delivery import Delivery, InvalidDelivery, verify_delivery

log = logging.getLogger("approvald_client.receiver")

#: ``handler(headers, raw_body) -> (http_status, json_body)``.
RequestHandler = Callable[[Mapping[str, str], bytes], "tuple[int, Any]"]

MAX_BODY = 1 << 20


def signed(secret: str, handle: Callable[[Delivery], "tuple[int, Any]"]) -> RequestHandler:
    """Wraps ``handle(delivery)`` so that it only ever sees verified deliveries:
    anything else is answered ``401`` (approvald never sends an unsigned
    delivery, so a 401 only ever reaches a forger)."""

    def handler(headers: Mapping[str, str], body: bytes) -> tuple[int, Any]:
        try:
            delivery = verify_delivery(secret, headers, body)
        except InvalidDelivery as e:
            log.warning("refused a delivery: %s", e)
            return 401, {"code": e.reason, "detail": e.detail}
        return handle(delivery)

    return handler


class DeliveryServer:
    """Serves ``POST <path>`` with ``handler`` and ``GET /healthz``.

    ``handler`` exceptions answer ``500`` so that approvald retries the
    delivery with the same idempotency key.
    """

    def __init__(self, handler: RequestHandler, host: str = "127.0.0.1", port: int = 0, path: str = "/approvals"):
        outer = self

        class _Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt: str, *args: Any) -> None:
                log.info("%s " + fmt, self.client_address[0], *args)

            def _send(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/healthz":
                    self._send(200, {"status": "ok"})
                else:
                    self._send(404, {"code": "not_found", "detail": "no such route"})

            def do_POST(self) -> None:  # noqa: N802
                if self.path != outer.path:
                    self._send(404, {"code": "not_found", "detail": "no such route"})
                    return
                try:
                    length = int(self.headers.get("Content-Length", "0"))
                except ValueError:
                    length = -1
                if length < 0 or length > MAX_BODY:
                    self.close_connection = True
                    self._send(413, {"code": "body_too_large", "detail": "the body is too large"})
                    return
                body = self.rfile.read(length)
                headers = {k.lower(): v for k, v in self.headers.items()}
                try:
                    status, out = outer.handler(headers, body)
                except Exception:  # answered 500: approvald retries
                    log.exception("delivery handler failed")
                    status, out = 500, {"code": "internal_error", "detail": "the worker failed; retry"}
                self._send(status, out)

        self.handler = handler
        self.path = path
        self.httpd = ThreadingHTTPServer((host, port), _Handler)
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.httpd.server_address[0]}:{self.port}{self.path}"

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.1)

    def start(self) -> DeliveryServer:
        self._thread = threading.Thread(target=self.serve_forever, name="approvald-deliveries", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

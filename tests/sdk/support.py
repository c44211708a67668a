"""Helpers shared by the SDK conformance suite: the sandbox's control routes,
a callback receiver, and bounded waits. Standard library only, so the only
package the venv needs is the `pushary` SDK under test.
"""

import http.server
import json
import os
import threading
import time
import urllib.error
import urllib.request

# How long any wait on a condition may take before the test fails.
WAIT_SECONDS = 15.0


def env(name):
    value = os.environ.get(name)
    if not value:
        raise SystemExit(f"the conformance suite needs {name} in its environment")
    return value


def control(method, path, body=None):
    """Calls the sandbox's `/sandbox/api` control routes; returns (status, json)."""
    data = json.dumps(body).encode("utf-8") if body is not None else None
    request = urllib.request.Request(
        env("SANDBOX_CONTROL_URL") + path,
        data=data,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=WAIT_SECONDS) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as error:
        raw = error.read()
        try:
            return error.code, json.loads(raw)
        except ValueError:
            return error.code, raw.decode("utf-8", "replace")


def http_get(url):
    """A plain GET (the enrollment link, as a phone opens it); returns the status."""
    try:
        with urllib.request.urlopen(url, timeout=WAIT_SECONDS) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def sandbox_decisions():
    status, decisions = control("GET", "/decisions")
    assert status == 200, (status, decisions)
    return decisions


def wait_until(condition, what, timeout=WAIT_SECONDS, interval=0.02):
    """Re-checks `condition` until it returns a truthy value, which is returned;
    fails the test with `what` when `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def pending_decision_with_key(idempotency_key):
    """The sandbox's pending decision created with this idempotency key, waited for."""

    def find():
        for decision in sandbox_decisions():
            if decision.get("idempotencyKey") == idempotency_key and decision["status"] == "pending":
                return decision
        return None

    return wait_until(find, f"a pending decision with idempotency key {idempotency_key}")


def sandbox_answer(decision_id, answer):
    """Answers as the phone would, through the control route."""
    from urllib.parse import quote

    status, body = control("POST", f"/decisions/{quote(decision_id, safe='')}/answer", {"answer": answer})
    assert status == 200, (status, body)
    return body


class Background:
    """Runs `fn` on a thread and hands back its result (or its exception)."""

    def __init__(self, fn):
        self._fn = fn
        self._result = None
        self._error = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        try:
            self._result = self._fn()
        except BaseException as error:  # handed to the test thread
            self._error = error

    def result(self, timeout=WAIT_SECONDS * 4):
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"the background call did not return within {timeout}s")
        if self._error is not None:
            raise self._error
        return self._result


class CallbackReceiver:
    """A tiny HTTP server on 127.0.0.1 port 0 that records every POST it gets,
    exactly as received (raw body bytes and headers), and answers 200."""

    def __init__(self):
        self.received = []
        self._cond = threading.Condition()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                with receiver._cond:
                    receiver.received.append(
                        {
                            "path": self.path,
                            "signature": self.headers.get("X-Pushary-Signature"),
                            "content_type": self.headers.get("Content-Type"),
                            "raw": raw,
                        }
                    )
                    receiver._cond.notify_all()
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_port}"

    def wait_for(self, path, count=1, timeout=WAIT_SECONDS):
        """The first `count` callbacks received on `path`, waited for."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: len([r for r in self.received if r["path"] == path]) >= count, timeout
            )
            got = [r for r in self.received if r["path"] == path]
        if not ok:
            raise AssertionError(f"no callback on {path} within {timeout}s (got {len(got)})")
        return got[:count]

    def close(self):
        self._server.shutdown()
        self._server.server_close()

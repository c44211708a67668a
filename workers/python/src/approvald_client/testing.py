"""Test support: run approvald and its Pushary sandbox as child processes on
127.0.0.1, answer decisions like the phone, capture and replay deliveries.

Used by the workers' end-to-end tests; an application can use it the same
way to test its own worker. Needs the approvald binary (``APPROVALD_BIN`` or
the ``approvald_bin`` argument). Standard library only; every wait is bounded.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

from .client import ApprovaldClient

T = TypeVar("T")

#: How long a test waits for anything approvald does, unless told otherwise.
WAIT = float(os.environ.get("APPROVALD_TEST_WAIT_SECS", "30"))

TERMINAL = frozenset(
    {"succeeded", "failed", "uncertain", "expired", "cancelled", "denied", "invalid", "refused", "unreachable"}
)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def free_port() -> int:
    """A port the OS just handed out on 127.0.0.1 (free at that moment)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], T], what: str, timeout: float = WAIT, interval: float = 0.02) -> T:
    """Calls ``predicate`` until it returns something truthy (returned), or
    raises ``TimeoutError`` naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as e:  # a condition that cannot be read yet is not met
            last_error = e
        if time.monotonic() >= deadline:
            hint = f" (last error: {last_error!r})" if last_error else ""
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}{hint}")
        time.sleep(interval)


def http_json(
    method: str, url: str, body: Any = None, headers: dict | None = None, timeout: float = 10
) -> tuple[int, Any]:
    """One request; returns ``(status, parsed JSON or text)`` whatever the status."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None and not any(k.lower() == "content-type" for k in (headers or {})):
        req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode("utf-8", "replace")


def new_webhook_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


class Process:
    """A child process whose stdout and stderr go to a log file."""

    def __init__(
        self, name: str, argv: list[str], log_path: Path, env: dict | None = None, cwd: str | Path | None = None
    ):
        self.name, self.argv, self.log_path, self.env, self.cwd = name, argv, Path(log_path), env, cwd
        self.proc: subprocess.Popen | None = None

    def start(self) -> Process:
        if self.alive:
            raise RuntimeError(f"{self.name} is already running")
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env, cwd=self.cwd
            )
        finally:
            log.close()
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout``."""
        if not self.alive:
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL: a crash, as far as the process can tell."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return _ANSI.sub("", "\n".join(text.splitlines()[-lines:]))

    def wait_http(self, url: str, timeout: float = WAIT) -> None:
        """Waits until ``GET url`` answers 2xx; fails at once if the process exits."""

        def ready() -> bool:
            if not self.alive:
                code = self.proc.returncode if self.proc else None
                raise RuntimeError(f"{self.name} exited ({code}) before it was ready:\n{self.log_tail()}")
            try:
                status, _ = http_json("GET", url, timeout=2)
            except OSError:
                return False
            return 200 <= status < 300

        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.name} not ready at {url} after {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.05)


class WorkerProcess(Process):
    """A worker (effect target) in a child process, serving ``GET /healthz``
    on ``port``; ``start`` returns once it answers."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        port: int,
        log_path: Path,
        env: dict | None = None,
        cwd: str | Path | None = None,
    ):
        super().__init__(name, argv, log_path, {**os.environ, **(env or {})}, cwd)
        self.port = port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> WorkerProcess:
        super().start()
        self.wait_http(f"{self.url}/healthz")
        return self

    def restart(self) -> WorkerProcess:
        self.stop()
        return self.start()


def approvald_bin(explicit: str | None = None) -> str:
    path = explicit or os.environ.get("APPROVALD_BIN")
    if not path:
        raise RuntimeError("set APPROVALD_BIN to the approvald binary (e.g. target/debug/approvald)")
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"APPROVALD_BIN={path} is not an executable file")
    return path


def _clean_env() -> dict:
    # Inherited APPROVALD_* variables would override the config we write.
    return {k: v for k, v in os.environ.items() if not k.startswith("APPROVALD_")}


class ApprovaldStack:
    """``approvald sandbox`` plus ``approvald serve`` on SQLite, on free ports.

    ``effects`` maps effect names to URLs; all share ``effect_secret``. The
    worker's retry backoff is short (``retry_initial_ms`` 50, ``retry_max_secs``
    1) and the reconciler sweeps every second, so expiries and retries happen
    within a test's patience.
    """

    TOKEN_BYTES = 24

    def __init__(
        self, workdir: str | Path, effects: dict[str, str], *, binary: str | None = None, extra_toml: str = ""
    ):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.effects = dict(effects)
        self.binary = approvald_bin(binary)
        self.extra_toml = extra_toml
        self.token = "test-" + secrets.token_hex(self.TOKEN_BYTES)
        self.effect_secret = new_webhook_secret()
        self.sandbox_key = "pk_sandbox." + secrets.token_hex(16)
        self.sandbox_webhook_secret = new_webhook_secret()
        self.sandbox_port = free_port()
        self.port = free_port()
        self.sandbox = Process(
            "approvald sandbox",
            [self.binary, "sandbox", "--listen", f"127.0.0.1:{self.sandbox_port}"],
            self.workdir / "sandbox.log",
            env={
                **_clean_env(),
                "APPROVALD_SANDBOX_API_KEY": self.sandbox_key,
                "APPROVALD_SANDBOX_WEBHOOK_SECRET": self.sandbox_webhook_secret,
            },
        )
        self.config_path = self.workdir / "approvald.toml"
        self.server = Process(
            "approvald serve",
            [self.binary, "serve", "--config", str(self.config_path)],
            self.workdir / "approvald.log",
            env=_clean_env(),
        )
        self.client = ApprovaldClient(self.base_url, self.token)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def sandbox_url(self) -> str:
        return f"http://127.0.0.1:{self.sandbox_port}"

    def config_toml(self) -> str:
        effects = "".join(
            f'\n[effects.{name}]\nurl = "{url}"\nsecret = "{self.effect_secret}"\ntimeout_secs = 20\n'
            for name, url in self.effects.items()
        )
        return f"""
[server]
listen = "127.0.0.1:{self.port}"
public_url = "{self.base_url}"
[store]
url = "sqlite://{self.workdir / "approvald.db"}"
[api]
tokens = ["{self.token}"]
[pushary]
base_url = "{self.sandbox_url}/api/v1/server"
api_key = "{self.sandbox_key}"
webhook_secrets = ["{self.sandbox_webhook_secret}"]
timeout_secs = 5
[worker]
retry_initial_ms = 50
retry_max_secs = 1
idle_poll_secs = 1
[reconciler]
interval_secs = 1
[log]
filter = "info"
{effects}
{self.extra_toml}
"""

    def start(self) -> ApprovaldStack:
        self.sandbox.start()
        self.sandbox.wait_http(f"{self.sandbox_url}/sandbox/api/info")
        self.config_path.write_text(self.config_toml())
        self.server.start()
        self.server.wait_http(f"{self.base_url}/readyz")
        return self

    def stop(self) -> None:
        self.server.stop()
        self.sandbox.stop()

    def __enter__(self) -> ApprovaldStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def logs(self) -> str:
        return f"--- approvald ---\n{self.server.log_tail()}\n--- sandbox ---\n{self.sandbox.log_tail(20)}"

    # -- driving operations ----------------------------------------------

    def decision_id(self, op_id: str, timeout: float = WAIT) -> str:
        """Waits until approvald opened the operation's decision at the sandbox."""
        return wait_until(
            lambda: self.client.get(op_id)["decisionId"],
            f"operation {op_id} to have its decision opened",
            timeout,
        )

    def answer(self, op_id: str, answer: str = "yes", *, callback: str = "send", timeout: float = WAIT) -> str:
        """Answers the operation's decision as the phone would; returns its id."""
        decision = self.decision_id(op_id, timeout)
        status, body = http_json(
            "POST",
            f"{self.sandbox_url}/sandbox/api/decisions/{decision}/answer",
            {"answer": answer, "callback": callback},
        )
        if status != 200:
            raise AssertionError(f"the sandbox refused the answer {answer!r}: {status} {body}")
        return decision

    def wait_state(self, op_id: str, states: str | set[str] | frozenset[str], timeout: float = WAIT) -> dict:
        """Waits until the operation is in one of ``states`` and its outcome
        was delivered (the effect target answered 2xx). Fails at once if it
        ends in another state or its delivery failed for good."""
        wanted = {states} if isinstance(states, str) else set(states)

        def reached() -> dict | None:
            op = self.client.get(op_id)
            if op["state"] in TERMINAL and op["state"] not in wanted:
                raise AssertionError(f"operation {op_id} ended {op['state']}, not {sorted(wanted)}: {json.dumps(op)}")
            if op.get("delivery") in ("failed", "abandoned", "unknown"):
                raise AssertionError(f"operation {op_id}: delivery {op['delivery']}: {json.dumps(op)}")
            if op["state"] in wanted and op.get("delivery") == "done":
                return op
            return None

        try:
            return wait_until_strict(reached, f"operation {op_id} to reach {sorted(wanted)}, delivered", timeout)
        except TimeoutError as e:
            raise TimeoutError(f"{e}\nlast: {json.dumps(self.client.get(op_id))}\n{self.logs()}") from None

    def wait_settled(self, op_id: str, timeout: float = WAIT) -> dict:
        """Waits until the operation is terminal with nothing left to deliver;
        returns it whatever the state (for tests that expect a failure)."""
        return wait_until(
            lambda: (op := self.client.get(op_id))["state"] in TERMINAL and op.get("delivery") != "pending" and op,
            f"operation {op_id} to settle",
            timeout,
        )

    def wait_failed_attempt(self, op_id: str, timeout: float = WAIT) -> dict:
        """Waits until approvald recorded at least one delivery attempt that
        failed (no answer or a 5xx): the target was down and it will retry."""
        return wait_until(
            lambda: (
                (op := self.client.get(op_id))
                and any(d.get("error") or (d.get("statusCode") or 0) >= 500 for d in op.get("deliveries", []))
                and op
            ),
            f"a failed delivery attempt for {op_id}",
            timeout,
        )


def wait_until_strict(predicate: Callable[[], T], what: str, timeout: float = WAIT, interval: float = 0.02) -> T:
    """Like ``wait_until``, but an ``AssertionError`` from ``predicate`` fails at once."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


@dataclass
class Captured:
    """One request that went through a ``RecordingProxy``, byte for byte."""

    path: str
    headers: list[tuple[str, str]]
    body: bytes
    status: int | None = None
    response: bytes = b""

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)

    def json(self) -> Any:
        return json.loads(self.body)


class RecordingProxy:
    """Forwards every POST to ``target`` and records it, so a test can
    replay a real signed delivery (a duplicate) byte for byte. Answers 502
    when the target is down, which approvald retries like any 5xx."""

    HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "host", "content-length"}

    def __init__(self, target: str):
        self.target = target.rstrip("/")
        self.captured: list[Captured] = []
        self._lock = threading.Lock()
        outer = self

        class _Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                record = Captured(self.path, list(self.headers.items()), body)
                with outer._lock:
                    outer.captured.append(record)
                headers = {k: v for k, v in record.headers if k.lower() not in outer.HOP_BY_HOP}
                try:
                    status, raw = _forward(outer.target + self.path, body, headers)
                except OSError as e:
                    status, raw = 502, json.dumps({"code": "bad_gateway", "detail": str(e)}).encode()
                record.status, record.response = status, raw
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def for_operation(self, op_id: str) -> list[Captured]:
        with self._lock:
            return [c for c in self.captured if c.json().get("operationId") == op_id]

    def replay(self, captured: Captured, url: str | None = None) -> tuple[int, bytes]:
        """POSTs the same bytes with the same headers again, to ``url`` or the target."""
        headers = {k: v for k, v in captured.headers if k.lower() not in self.HOP_BY_HOP}
        return _forward(url or (self.target + captured.path), captured.body, headers)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _forward(url: str, body: bytes, headers: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def forged_delivery(url: str, body: dict, *, secret: str | None = None) -> tuple[int, Any]:
    """POSTs ``body`` as a delivery signed with ``secret`` (default: a fresh
    random one, i.e. a forgery); returns ``(status, body)``."""
    from .delivery import sign

    raw = json.dumps(body).encode()
    msg_id, ts = "msg_forged_" + secrets.token_hex(4), int(time.time())
    headers = {
        "webhook-id": msg_id,
        "webhook-timestamp": str(ts),
        "webhook-signature": sign(secret or new_webhook_secret(), msg_id, ts, raw),
        "Idempotency-Key": body.get("idempotencyKey", "forged"),
    }
    return http_json("POST", url, raw, headers)


class WorkerHarness:
    """approvald, its sandbox and a worker process wired together.

    Two effect targets point at the worker: ``orders`` through a
    ``RecordingProxy`` (so a test can replay a real delivery byte for byte)
    and ``orders_direct`` straight at it (so a stopped worker is a refused
    connection). The worker gets ``APPROVALD_URL``, ``APPROVALD_TOKEN`` and
    ``APPROVALD_EFFECT_SECRET`` in its environment.
    """

    def __init__(
        self,
        workdir: str | Path,
        worker_argv: Callable[[int], list[str]],
        *,
        name: str = "worker",
        path: str = "/approvals",
        env: dict | None = None,
        cwd: str | Path | None = None,
        binary: str | None = None,
    ):
        self.workdir = Path(workdir)
        self.path = path
        port = free_port()
        self.proxy = RecordingProxy(f"http://127.0.0.1:{port}")
        self.stack = ApprovaldStack(
            self.workdir / "approvald",
            {"orders": self.proxy.url + path, "orders_direct": f"http://127.0.0.1:{port}{path}"},
            binary=binary,
        )
        self.worker = WorkerProcess(
            name,
            worker_argv(port),
            port,
            self.workdir / "worker.log",
            env={
                "APPROVALD_URL": self.stack.base_url,
                "APPROVALD_TOKEN": self.stack.token,
                "APPROVALD_EFFECT_SECRET": self.stack.effect_secret,
                **(env or {}),
            },
            cwd=cwd,
        )

    @property
    def client(self) -> ApprovaldClient:
        return self.stack.client

    @property
    def delivery_url(self) -> str:
        return self.worker.url + self.path

    def start(self) -> WorkerHarness:
        self.stack.start()
        try:
            self.worker.start()
        except BaseException:
            self.stack.stop()
            raise
        return self

    def stop(self) -> None:
        self.worker.stop()
        self.stack.stop()
        self.proxy.close()

    def __enter__(self) -> WorkerHarness:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def logs(self) -> str:
        return f"{self.stack.logs()}\n--- {self.worker.name} ---\n{self.worker.log_tail()}"

    def wait_state(self, op_id: str, states: str | set[str], timeout: float = WAIT) -> dict:
        try:
            return self.stack.wait_state(op_id, states, timeout)
        except (TimeoutError, AssertionError) as e:
            raise AssertionError(f"{e}\n--- {self.worker.name} ---\n{self.worker.log_tail()}") from None

    def replay(self, op_id: str) -> tuple[int, Any]:
        """Re-POSTs the last delivery approvald made for ``op_id`` (same
        bytes, same signature headers) straight to the worker."""
        captured = self.proxy.for_operation(op_id)
        if not captured:
            raise AssertionError(f"no delivery of {op_id} went through the proxy")
        status, raw = self.proxy.replay(captured[-1], self.delivery_url)
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw

    def forge(self, body: dict, secret: str | None = None) -> tuple[int, Any]:
        """POSTs ``body`` to the worker signed with a key that is not the
        effect secret: what an attacker without the secret can send."""
        return forged_delivery(self.delivery_url, body, secret=secret)

    def forged_approval(self, op: dict, **overrides: Any) -> dict:
        """A plausible approval of ``op`` that approvald never sent."""
        body = {
            "operationId": op["id"],
            "operationKey": op["operationKey"],
            "threadId": op["threadId"],
            "interruptId": op["interruptId"],
            "checkpointId": op.get("checkpointId"),
            "decisionId": "dec_forged",
            "correlationId": "dec_forged",
            "type": "confirm",
            "status": "approved",
            "approved": True,
            "answer": "yes",
            "permitId": "prm_forged",
            "idempotencyKey": "idem-forged-" + secrets.token_hex(4),
            "revision": None,
            "subject": {"externalId": "attacker", "parameters": {}},
            "deadline": "2099-01-01T00:00:00.000Z",
        }
        body.update(overrides)
        return body

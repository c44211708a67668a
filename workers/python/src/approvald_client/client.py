"""HTTP client for approvald's operations API (standard library only)."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

# The enqueue fields of approvald's README, by their wire (camelCase) names.
ENQUEUE_FIELDS = frozenset(
    {
        "operationKey",
        "threadId",
        "interruptId",
        "checkpointId",
        "effect",
        "externalId",
        "question",
        "type",
        "options",
        "toolName",
        "toolTarget",
        "actor",
        "environment",
        "parameters",
        "context",
        "placeholder",
        "presentation",
        "agentName",
        "revision",
        "expiresInSeconds",
        "deadline",
    }
)


class ApprovaldError(Exception):
    """approvald answered with an error, or could not be reached.

    ``status`` is the HTTP status (``None`` when approvald was not reached),
    ``code`` and ``detail`` come from approvald's ``{code, detail, field}``
    error body, ``field`` names the enqueue field at fault when there is one.
    """

    def __init__(self, status: int | None, code: str, detail: str, field: str | None = None):
        self.status = status
        self.code = code
        self.detail = detail
        self.field = field
        where = f" (field `{field}`)" if field else ""
        super().__init__(f"approvald {status if status is not None else 'unreachable'} {code}: {detail}{where}")


def camel_case(name: str) -> str:
    """``expires_in_seconds`` -> ``expiresInSeconds``."""
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


class ApprovaldClient:
    """Talks to approvald's ``/v1/operations`` API with a bearer token.

    >>> client = ApprovaldClient("http://127.0.0.1:8080", "approvald-dev-token")
    >>> op = client.enqueue(operation_key="demo-1", thread_id="t-1", interrupt_id="i-1",
    ...                     effect="orders", external_id="user-1", question="Refund 40 EUR?")
    """

    def __init__(self, base_url: str, token: str, *, timeout: float = 10.0):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError("base_url must be an http:// or https:// URL")
        self.base_url = base_url.rstrip("/")
        self._token = token
        self.timeout = timeout

    def __repr__(self) -> str:  # never shows the token
        return f"ApprovaldClient({self.base_url!r})"

    # -- operations -------------------------------------------------------

    def enqueue(self, **fields: Any) -> dict:
        """``POST /v1/operations``. Keyword arguments are the README's fields in
        snake_case (``operation_key=``, ``thread_id=``, ``expires_in_seconds=``…);
        only the fields given (and not ``None``) are sent. Returns the operation.
        Enqueue is idempotent on ``operation_key``: the same key with the same
        content returns the existing operation.
        """
        body: dict[str, Any] = {}
        for name, value in fields.items():
            wire = camel_case(name)
            if wire not in ENQUEUE_FIELDS:
                raise TypeError(f"enqueue() got an unknown field {name!r}")
            if value is not None:
                body[wire] = value
        return self._request("POST", "/v1/operations", body)

    def get(self, op_id: str) -> dict:
        """``GET /v1/operations/{id}``: state, answer, permit, deliveries, history."""
        return self._request("GET", f"/v1/operations/{_segment(op_id)}")

    def cancel(self, op_id: str) -> dict:
        """``DELETE /v1/operations/{id}``: cancels it (at Pushary too); the
        cancellation is delivered to the effect target like any outcome."""
        return self._request("DELETE", f"/v1/operations/{_segment(op_id)}")

    def list(self, *, state: str | None = None, thread_id: str | None = None, limit: int | None = None) -> list:
        """``GET /v1/operations?state=&threadId=&limit=``."""
        query = {k: v for k, v in (("state", state), ("threadId", thread_id), ("limit", limit)) if v is not None}
        path = "/v1/operations" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        return self._request("GET", path)["operations"]

    # -- transport --------------------------------------------------------

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self._token}")
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise _error_from(e.code, e.read()) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ApprovaldError(None, "unreachable", f"{method} {path}: {reason}") from None
        try:
            return json.loads(raw)
        except ValueError:
            raise ApprovaldError(None, "invalid_response", f"{method} {path}: the answer is not JSON") from None


def _segment(op_id: str) -> str:
    if not op_id:
        raise ValueError("operation id must not be empty")
    return urllib.parse.quote(op_id, safe="")


def _error_from(status: int, raw: bytes) -> ApprovaldError:
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("code"), str):
        return ApprovaldError(status, body["code"], str(body.get("detail", "")), body.get("field"))
    text = raw.decode("utf-8", "replace")[:500]
    return ApprovaldError(status, "http_error", text or f"HTTP {status}")

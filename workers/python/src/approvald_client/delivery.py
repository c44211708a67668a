"""Verifying approvald's deliveries: Standard Webhooks signatures
(https://www.standardwebhooks.com), checked in constant time, and the typed
delivery body."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: How far ``webhook-timestamp`` may be from now, in seconds (as the spec's libraries).
TOLERANCE_SECS = 300

#: Every status approvald delivers; only ``approved`` carries permission.
STATUSES = frozenset({"approved", "denied", "answered", "expired", "cancelled", "invalid", "refused", "unreachable"})


class InvalidDelivery(Exception):
    """The request is not a valid delivery from approvald: a header is
    missing, the timestamp is stale, no signature matches, or the body is not
    a delivery. ``reason`` is a stable short code."""

    def __init__(self, reason: str, detail: str):
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


@dataclass(frozen=True)
class Subject:
    external_id: str
    tool_name: str | None = None
    tool_target: str | None = None
    actor: str | None = None
    environment: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Delivery:
    """One verified outcome, as approvald POSTs it to an effect target."""

    operation_id: str
    operation_key: str
    thread_id: str
    interrupt_id: str
    checkpoint_id: str | None
    decision_id: str | None
    correlation_id: str | None
    type: str
    status: str
    approved: bool
    answer: str | None
    permit_id: str | None
    idempotency_key: str
    revision: str | None
    subject: Subject
    deadline: str
    #: The ``webhook-id`` header: stable across retries of this delivery.
    webhook_id: str
    #: The parsed body as sent.
    raw: dict = field(repr=False, compare=False, default_factory=dict)

    @property
    def grants_permission(self) -> bool:
        """True only for an approved confirm whose permit approvald consumed:
        the one case in which the protected action may run."""
        return self.status == "approved" and self.approved is True and bool(self.permit_id)

    def resume_value(self) -> dict:
        """A JSON-able summary to hand to a paused run (no secrets in it)."""
        return {
            "operationId": self.operation_id,
            "interruptId": self.interrupt_id,
            "status": self.status,
            "approved": self.grants_permission,
            "answer": self.answer,
            "permitId": self.permit_id if self.grants_permission else None,
            "idempotencyKey": self.idempotency_key,
            "decisionId": self.decision_id,
        }


def decode_secret(secret: str) -> bytes:
    """The key bytes of a ``whsec_<base64>`` secret (raises ``ValueError``)."""
    if not isinstance(secret, str) or not secret.startswith("whsec_"):
        raise ValueError("the effect secret must be a `whsec_<base64>` string")
    try:
        key = base64.b64decode(secret[len("whsec_") :], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the part after `whsec_` must be base64") from None
    if not key:
        raise ValueError("the effect secret must not be empty")
    return key


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """One ``v1,<base64>`` signature, as approvald computes it (for tests and tools)."""
    key = decode_secret(secret)
    return "v1," + base64.b64encode(_mac(key, msg_id, str(timestamp), body)).decode()


def _mac(key: bytes, msg_id: str, timestamp: str, body: bytes) -> bytes:
    return hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()


def _header(headers: Any, name: str) -> str | None:
    items = headers.items() if hasattr(headers, "items") else headers
    for k, v in items:
        if k.lower() == name:
            return v
    return None


def verify_signature(secret: str, headers: Mapping[str, str] | Any, body: bytes | str, now: float | None = None) -> str:
    """Checks the Standard Webhooks headers of a request; returns its ``webhook-id``.

    ``headers`` is any mapping (or ``email.message.Message``, as
    ``http.server`` gives); names are matched case-insensitively.
    """
    key = decode_secret(secret)
    raw = body.encode() if isinstance(body, str) else bytes(body)
    msg_id = _header(headers, "webhook-id")
    timestamp = _header(headers, "webhook-timestamp")
    signatures = _header(headers, "webhook-signature")
    if not msg_id or not timestamp or not signatures:
        raise InvalidDelivery("missing_header", "webhook-id, webhook-timestamp and webhook-signature are required")
    if not timestamp.isascii() or not timestamp.isdigit():
        raise InvalidDelivery("invalid_timestamp", "webhook-timestamp must be whole seconds since the epoch")
    now = time.time() if now is None else now
    if abs(now - int(timestamp)) > TOLERANCE_SECS:
        raise InvalidDelivery("stale_timestamp", "webhook-timestamp is more than 5 minutes from now")
    expected = base64.b64encode(_mac(key, msg_id, timestamp, raw))
    matched = False
    for candidate in signatures.split(" "):
        version, _, sig = candidate.partition(",")
        # Compare every v1 candidate in constant time; no early exit on content.
        if version == "v1" and hmac.compare_digest(sig.encode(), expected):
            matched = True
    if not matched:
        raise InvalidDelivery("bad_signature", "no webhook-signature matches the body")
    return msg_id


def verify_delivery(
    secret: str, headers: Mapping[str, str] | Any, body: bytes | str, now: float | None = None
) -> Delivery:
    """Verifies a delivery's signature and timestamp (within 5 minutes of
    ``now``, default the current time) and parses its body.

    Raises ``InvalidDelivery`` when the request did not come from approvald
    (or is stale or malformed); ``ValueError`` when ``secret`` is not a
    ``whsec_`` secret.
    """
    msg_id = verify_signature(secret, headers, body, now)
    raw = body.encode() if isinstance(body, str) else bytes(body)
    try:
        data = json.loads(raw)
    except ValueError:
        raise InvalidDelivery("invalid_body", "the body is not JSON") from None
    return parse_delivery(data, webhook_id=msg_id)


def parse_delivery(data: Any, *, webhook_id: str = "") -> Delivery:
    """The typed form of a delivery body (already verified)."""
    if not isinstance(data, dict):
        raise InvalidDelivery("invalid_body", "the body is not a JSON object")

    def text(name: str, required: bool = True) -> str | None:
        value = data.get(name)
        if value is None and not required:
            return None
        if not isinstance(value, str) or (required and not value):
            raise InvalidDelivery("invalid_body", f"`{name}` must be a string")
        return value

    status = text("status")
    if status not in STATUSES:
        raise InvalidDelivery("invalid_body", f"unknown status `{status}`")
    approved = data.get("approved")
    if not isinstance(approved, bool):
        raise InvalidDelivery("invalid_body", "`approved` must be a boolean")
    subject = data.get("subject") or {}
    if not isinstance(subject, dict):
        raise InvalidDelivery("invalid_body", "`subject` must be an object")
    params = subject.get("parameters") or {}
    return Delivery(
        operation_id=text("operationId"),
        operation_key=text("operationKey"),
        thread_id=text("threadId"),
        interrupt_id=text("interruptId"),
        checkpoint_id=text("checkpointId", False),
        decision_id=text("decisionId", False),
        correlation_id=text("correlationId", False),
        type=text("type"),
        status=status,
        approved=approved,
        answer=text("answer", False),
        permit_id=text("permitId", False),
        idempotency_key=text("idempotencyKey"),
        revision=text("revision", False),
        subject=Subject(
            external_id=str(subject.get("externalId", "")),
            tool_name=subject.get("toolName"),
            tool_target=subject.get("toolTarget"),
            actor=subject.get("actor"),
            environment=subject.get("environment"),
            parameters=dict(params) if isinstance(params, dict) else {},
        ),
        deadline=text("deadline"),
        webhook_id=webhook_id,
        raw=data,
    )

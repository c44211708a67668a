"""verify_delivery: Standard Webhooks signatures, timestamps, the typed body."""

import base64
import json
import secrets
from datetime import datetime, timezone

import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

import approvald_client
from approvald_client import InvalidDelivery, sign, verify_delivery, verify_signature
from approvald_client.receiver import signed

SECRET = "whsec_" + base64.b64encode(b"0123456789abcdef01234567").decode()
NOW = 1_800_000_000

BODY = {
    "operationId": "op_1",
    "operationKey": "key-1",
    "threadId": "thread-1",
    "interruptId": "interrupt-1",
    "checkpointId": None,
    "decisionId": "dec_1",
    "correlationId": "dec_1",
    "type": "confirm",
    "status": "approved",
    "approved": True,
    "answer": "yes",
    "permitId": "prm_1",
    "idempotencyKey": "idem-1",
    "revision": None,
    "subject": {"externalId": "user-1", "toolName": "refund", "parameters": {"amount": 40}},
    "deadline": "2027-01-15T08:00:00.000Z",
}


def signed_request(body=BODY, secret=SECRET, ts=NOW, msg_id="msg_op_1"):
    raw = json.dumps(body).encode()
    headers = {"webhook-id": msg_id, "webhook-timestamp": str(ts), "webhook-signature": sign(secret, msg_id, ts, raw)}
    return headers, raw


def test_specification_example():
    # The Standard Webhooks reference example (also in approvald's src/webhooks.rs).
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    body = b'{"test": 2432232314}'
    sig = sign(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body)
    assert sig == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    headers = {
        "webhook-id": "msg_p5jXN8AQM9LWM0D4loKWxJek",
        "webhook-timestamp": "1614265330",
        "webhook-signature": sig,
    }
    assert verify_signature(secret, headers, body, now=1614265330) == "msg_p5jXN8AQM9LWM0D4loKWxJek"


def test_valid_delivery_is_typed():
    headers, raw = signed_request()
    d = verify_delivery(SECRET, headers, raw, now=NOW)
    assert d.operation_id == "op_1" and d.thread_id == "thread-1" and d.interrupt_id == "interrupt-1"
    assert d.status == "approved" and d.approved is True and d.permit_id == "prm_1"
    assert d.grants_permission
    assert d.idempotency_key == "idem-1" and d.webhook_id == "msg_op_1"
    assert d.subject.external_id == "user-1" and d.subject.tool_name == "refund"
    assert d.subject.parameters == {"amount": 40}
    assert d.checkpoint_id is None and d.raw == BODY
    assert d.resume_value()["approved"] is True


def test_body_given_as_str_and_headers_in_any_case():
    headers, raw = signed_request()
    upper = {k.upper(): v for k, v in headers.items()}
    assert verify_delivery(SECRET, upper, raw.decode(), now=NOW).operation_id == "op_1"


@pytest.mark.parametrize("status", ["denied", "expired", "cancelled", "invalid", "refused", "unreachable", "answered"])
def test_no_other_status_grants_permission(status):
    body = {**BODY, "status": status, "approved": False, "permitId": None}
    headers, raw = signed_request(body)
    d = verify_delivery(SECRET, headers, raw, now=NOW)
    assert not d.grants_permission and d.resume_value()["permitId"] is None


def test_approved_without_permit_is_no_permission():
    body = {**BODY, "permitId": None}
    headers, raw = signed_request(body)
    assert not verify_delivery(SECRET, headers, raw, now=NOW).grants_permission


def test_wrong_secret_is_refused():
    headers, raw = signed_request(secret="whsec_" + base64.b64encode(secrets.token_bytes(24)).decode())
    with pytest.raises(InvalidDelivery) as e:
        verify_delivery(SECRET, headers, raw, now=NOW)
    assert e.value.reason == "bad_signature"


def test_tampered_body_is_refused():
    headers, raw = signed_request()
    tampered = raw.replace(b'"idem-1"', b'"idem-2"')
    assert tampered != raw
    with pytest.raises(InvalidDelivery, match="bad_signature"):
        verify_delivery(SECRET, headers, tampered, now=NOW)


def test_tampered_id_or_timestamp_is_refused():
    headers, raw = signed_request()
    with pytest.raises(InvalidDelivery, match="bad_signature"):
        verify_delivery(SECRET, {**headers, "webhook-id": "msg_other"}, raw, now=NOW)
    with pytest.raises(InvalidDelivery, match="bad_signature"):
        verify_delivery(SECRET, {**headers, "webhook-timestamp": str(NOW + 1)}, raw, now=NOW)


@pytest.mark.parametrize("skew", [301, -301, 10_000])
def test_stale_or_future_timestamp_is_refused(skew):
    headers, raw = signed_request()
    with pytest.raises(InvalidDelivery) as e:
        verify_delivery(SECRET, headers, raw, now=NOW + skew)
    assert e.value.reason == "stale_timestamp"


def test_timestamp_at_the_edge_is_accepted():
    headers, raw = signed_request()
    assert verify_delivery(SECRET, headers, raw, now=NOW + 300).operation_id == "op_1"
    assert verify_delivery(SECRET, headers, raw, now=NOW - 300).operation_id == "op_1"


def test_several_signatures_any_one_matches():
    headers, raw = signed_request()
    other = sign("whsec_" + base64.b64encode(b"x" * 24).decode(), "msg_op_1", NOW, raw)
    for combined in (f"{other} {headers['webhook-signature']}", f"{headers['webhook-signature']} {other}"):
        assert verify_delivery(SECRET, {**headers, "webhook-signature": combined}, raw, now=NOW)
    with pytest.raises(InvalidDelivery, match="bad_signature"):
        verify_delivery(SECRET, {**headers, "webhook-signature": f"{other} {other}"}, raw, now=NOW)


def test_other_versions_are_ignored():
    headers, raw = signed_request()
    v2 = headers["webhook-signature"].replace("v1,", "v2,")
    with pytest.raises(InvalidDelivery, match="bad_signature"):
        verify_delivery(SECRET, {**headers, "webhook-signature": v2}, raw, now=NOW)


@pytest.mark.parametrize("missing", ["webhook-id", "webhook-timestamp", "webhook-signature"])
def test_missing_header_is_refused(missing):
    headers, raw = signed_request()
    del headers[missing]
    with pytest.raises(InvalidDelivery) as e:
        verify_delivery(SECRET, headers, raw, now=NOW)
    assert e.value.reason == "missing_header"


def test_non_numeric_timestamp_is_refused():
    headers, raw = signed_request()
    with pytest.raises(InvalidDelivery, match="invalid_timestamp"):
        verify_delivery(SECRET, {**headers, "webhook-timestamp": "1e9"}, raw, now=NOW)


@pytest.mark.parametrize(
    "body",
    [
        [1, 2],
        {**BODY, "status": "maybe"},
        {**BODY, "approved": "true"},
        {k: v for k, v in BODY.items() if k != "idempotencyKey"},
    ],
)
def test_signed_but_malformed_body_is_refused(body):
    headers, raw = signed_request(body)
    with pytest.raises(InvalidDelivery, match="invalid_body"):
        verify_delivery(SECRET, headers, raw, now=NOW)


@pytest.mark.parametrize("secret", ["MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "whsec_not base64!", "whsec_"])
def test_bad_secret_is_a_configuration_error(secret):
    headers, raw = signed_request()
    with pytest.raises(ValueError):
        verify_delivery(secret, headers, raw, now=NOW)


def test_signatures_are_compared_in_constant_time(monkeypatch):
    calls = []
    real = approvald_client.delivery.hmac.compare_digest

    def recording(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(approvald_client.delivery.hmac, "compare_digest", recording)
    headers, raw = signed_request()
    bad = "v1," + base64.b64encode(b"\0" * 32).decode()
    verify_delivery(SECRET, {**headers, "webhook-signature": f"{bad} {headers['webhook-signature']}"}, raw, now=NOW)
    assert len(calls) == 2, "every v1 candidate goes through hmac.compare_digest"


# -- against the maintained standardwebhooks library ----------------------


@pytest.mark.parametrize("seed", range(20))
def test_same_signature_as_standardwebhooks(seed):
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(16 + seed)).decode()
    body = json.dumps({**BODY, "operationKey": f"key-{seed}-é", "n": secrets.randbits(64)})
    msg_id = f"msg_{secrets.token_hex(6)}"
    ts = NOW + seed
    theirs = Webhook(secret).sign(msg_id, datetime.fromtimestamp(ts, tz=timezone.utc), body)
    assert sign(secret, msg_id, ts, body.encode()) == theirs


def test_standardwebhooks_accepts_ours_and_we_accept_theirs():
    import time

    ts = int(time.time())
    raw = json.dumps(BODY).encode()
    ours = {"webhook-id": "msg_x", "webhook-timestamp": str(ts), "webhook-signature": sign(SECRET, "msg_x", ts, raw)}
    assert Webhook(SECRET).verify(raw, ours) == BODY
    theirs = {
        **ours,
        "webhook-signature": Webhook(SECRET).sign("msg_x", datetime.fromtimestamp(ts, tz=timezone.utc), raw.decode()),
    }
    assert verify_delivery(SECRET, theirs, raw).operation_id == "op_1"
    # And both refuse the same forgery.
    forged = {**ours, "webhook-signature": sign("whsec_" + base64.b64encode(b"y" * 24).decode(), "msg_x", ts, raw)}
    with pytest.raises(WebhookVerificationError):
        Webhook(SECRET).verify(raw, forged)
    with pytest.raises(InvalidDelivery):
        verify_delivery(SECRET, forged, raw)


def test_signed_wrapper_answers_401_to_forgeries():
    seen = []
    handler = signed(SECRET, lambda d: seen.append(d) or (200, {"ok": True}))
    headers, raw = signed_request(ts=int(__import__("time").time()))
    assert handler(headers, raw) == (200, {"ok": True})
    forged_headers, _ = signed_request(secret="whsec_" + base64.b64encode(b"z" * 24).decode())
    status, body = handler(forged_headers, raw)
    assert status == 401 and body["code"] in {"bad_signature", "stale_timestamp"}
    assert len(seen) == 1

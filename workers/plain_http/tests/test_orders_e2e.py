"""The plain HTTP order service against approvald and the sandbox: the
service runs in its own process; answers are given through the sandbox."""

import itertools

import pytest

from approvald_client.testing import http_json
from orders_service import OrderService, request_order

_refs = itertools.count(1)


@pytest.fixture
def order_ref(request):
    return f"{request.node.name}-{next(_refs)}"


def orders(harness, ref):
    return OrderService(harness.db_path).orders(ref)


def test_approve_places_the_order_once(harness, order_ref):
    op = request_order(harness.client, order_ref=order_ref, amount=40, currency="EUR", approver="user-1")
    harness.stack.answer(op["id"], "yes")
    done = harness.wait_state(op["id"], "succeeded")
    assert done["result"] == {"placed": True, "orderRef": order_ref, "permitId": done["permitId"]}
    [order] = orders(harness, order_ref)
    assert order["permit_id"] == done["permitId"] and order["idempotency_key"] == done["idempotencyKey"]
    assert (order["amount"], order["currency"]) == (40, "EUR")


def test_deny_places_nothing(harness, order_ref):
    op = request_order(harness.client, order_ref=order_ref, amount=10, currency="EUR", approver="user-1")
    harness.stack.answer(op["id"], "no")
    done = harness.wait_state(op["id"], "denied")
    assert done["result"] == {"placed": False, "status": "denied"}
    assert orders(harness, order_ref) == []


def test_expiry_places_nothing(harness, order_ref):
    op = request_order(
        harness.client, order_ref=order_ref, amount=10, currency="EUR", approver="user-1", expires_in_seconds=2
    )
    done = harness.wait_state(op["id"], "expired")
    assert done["result"] == {"placed": False, "status": "expired"}
    assert orders(harness, order_ref) == []


def test_duplicate_delivery_places_no_second_order(harness, order_ref):
    op = request_order(harness.client, order_ref=order_ref, amount=7, currency="EUR", approver="user-1")
    harness.stack.answer(op["id"], "yes")
    done = harness.wait_state(op["id"], "succeeded")
    for _ in range(3):
        status, body = harness.replay(op["id"])
        assert status == 200 and body == done["result"]
    assert len(orders(harness, order_ref)) == 1


def test_forged_delivery_is_refused(harness, order_ref):
    op = request_order(harness.client, order_ref=order_ref, amount=999, currency="EUR", approver="user-1")
    harness.stack.decision_id(op["id"])
    forged = harness.forged_approval(
        op,
        subject={
            "externalId": "x",
            "toolName": "place_order",
            "toolTarget": order_ref,
            "parameters": {"amount": 999, "currency": "EUR"},
        },
    )
    status, body = harness.forge(forged)
    assert status == 401 and body["code"] == "bad_signature"
    # Unsigned, too.
    status, body = http_json("POST", harness.delivery_url, forged)
    assert status == 401 and body["code"] == "missing_header"
    assert orders(harness, order_ref) == []
    # The real answer still goes through.
    harness.stack.answer(op["id"], "no")
    harness.wait_state(op["id"], "denied")
    assert orders(harness, order_ref) == []


def test_restart_between_pause_and_answer(harness, order_ref):
    op = request_order(
        harness.client, order_ref=order_ref, amount=12, currency="EUR", approver="user-1", effect="orders_direct"
    )
    harness.stack.decision_id(op["id"])
    harness.worker.kill()
    harness.stack.answer(op["id"], "yes")
    harness.stack.wait_failed_attempt(op["id"])
    assert orders(harness, order_ref) == []
    harness.worker.start()
    done = harness.wait_state(op["id"], "succeeded")
    [order] = orders(harness, order_ref)
    assert order["permit_id"] == done["permitId"]

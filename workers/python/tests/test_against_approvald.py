"""The client against a real approvald and its sandbox (child processes):
enqueue, errors, an approval delivered to a DeliveryServer and verified."""

import threading

import pytest

from approvald_client import ApprovaldClient, ApprovaldError, Delivery
from approvald_client.receiver import DeliveryServer, signed
from approvald_client.testing import ApprovaldStack, RecordingProxy, free_port, wait_until


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    received: list[Delivery] = []
    lock = threading.Lock()

    def handle(delivery: Delivery):
        with lock:
            received.append(delivery)
        return 200, {"done": delivery.status}

    port = free_port()
    proxy = RecordingProxy(f"http://127.0.0.1:{port}")
    stack = ApprovaldStack(tmp_path_factory.mktemp("approvald"), {"orders": f"{proxy.url}/approvals"})
    server = DeliveryServer(signed(stack.effect_secret, handle), port=port).start()
    with stack:
        yield stack, received, proxy
    server.close()
    proxy.close()


def fields(key, **extra):
    return dict(
        operation_key=key,
        thread_id=f"thread-{key}",
        interrupt_id=f"interrupt-{key}",
        effect="orders",
        external_id="user-1",
        question="Refund 40 EUR on order 1234?",
        tool_name="refund",
        tool_target="order-1234",
        parameters={"amount": 40, "currency": "EUR"},
        **extra,
    )


def test_enqueue_is_idempotent_and_conflicts_are_errors(setup):
    stack, _, _ = setup
    op = stack.client.enqueue(**fields("idem"))
    assert op["id"].startswith("op_") and op["operationKey"] == "idem"
    assert stack.client.enqueue(**fields("idem"))["id"] == op["id"]
    with pytest.raises(ApprovaldError) as e:
        stack.client.enqueue(**{**fields("idem"), "question": "Something else?"})
    assert e.value.status == 409 and e.value.code == "operation_key_conflict"


def test_violated_bound_names_the_field(setup):
    stack, _, _ = setup
    with pytest.raises(ApprovaldError) as e:
        stack.client.enqueue(**fields("bound", expires_in_seconds=0))
    assert e.value.status == 422 and e.value.field == "expiresInSeconds"


def test_wrong_token_is_401(setup):
    stack, _, _ = setup
    with pytest.raises(ApprovaldError) as e:
        ApprovaldClient(stack.base_url, "wrong-token-0123456789").get("op_x")
    assert e.value.status == 401


def test_unknown_operation_is_404(setup):
    stack, _, _ = setup
    with pytest.raises(ApprovaldError) as e:
        stack.client.get("op_does_not_exist")
    assert e.value.status == 404


def test_approval_is_delivered_signed_and_verified(setup):
    stack, received, proxy = setup
    op = stack.client.enqueue(**fields("approve"))
    stack.answer(op["id"], "yes")
    done = stack.wait_state(op["id"], "succeeded")
    assert done["result"] == {"done": "approved"}
    d = next(d for d in received if d.operation_id == op["id"])
    assert d.grants_permission and d.permit_id == done["permitId"]
    assert d.idempotency_key == done["idempotencyKey"]
    assert d.subject.parameters == {"amount": 40, "currency": "EUR"}
    captured = proxy.for_operation(op["id"])
    assert captured and captured[0].header("Idempotency-Key") == d.idempotency_key


def test_cancel_is_delivered(setup):
    stack, received, _ = setup
    op = stack.client.enqueue(**fields("cancel"))
    stack.decision_id(op["id"])
    stack.client.cancel(op["id"])
    stack.wait_state(op["id"], "cancelled")
    d = wait_until(lambda: next((d for d in received if d.operation_id == op["id"]), None), "the cancellation delivery")
    assert d.status == "cancelled" and not d.grants_permission

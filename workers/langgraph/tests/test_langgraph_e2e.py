"""LangGraph worker end to end: the graph pauses in this process, approvald
and the sandbox run as child processes, the worker resumes the thread in its
own process."""

import itertools

import pytest

from approvald_client.testing import http_json

_n = itertools.count(1)


@pytest.fixture
def thread(request):
    return f"{request.node.name}-{next(_n)}"


def pause(app, thread, amount=40, **kw):
    [op] = app.start_refund(thread, f"order-{thread}", amount, "EUR", approver="user-1", **kw)
    snap = app.state(thread)
    assert [i.id for i in snap.interrupts] == [op["interruptId"]]
    assert op["checkpointId"] == snap.config["configurable"]["checkpoint_id"]
    assert app.refunds.list(thread) == []
    return op


def test_approve_resumes_and_refunds_once(harness, app, thread):
    op = pause(app, thread)
    harness.stack.answer(op["id"], "yes")
    done = harness.wait_state(op["id"], "succeeded")
    [refund] = app.refunds.list(thread)
    assert refund["permit_id"] == done["permitId"] and refund["idempotency_key"] == done["idempotencyKey"]
    snap = app.state(thread)
    assert snap.interrupts == () and snap.next == ()
    assert snap.values["refund"] == {"refunded": True, "status": "approved", "permitId": done["permitId"]}
    assert done["result"]["result"] == snap.values["refund"] and done["result"]["pendingInterrupts"] == []


def test_deny_resumes_with_a_rejection(harness, app, thread):
    op = pause(app, thread)
    harness.stack.answer(op["id"], "no")
    harness.wait_state(op["id"], "denied")
    snap = app.state(thread)
    assert snap.interrupts == () and snap.values["refund"] == {"refunded": False, "status": "denied"}
    assert app.refunds.list(thread) == []


def test_expiry_resumes_with_a_rejection(harness, app, thread):
    op = pause(app, thread, expires_in_seconds=2)
    harness.wait_state(op["id"], "expired")
    snap = app.state(thread)
    assert snap.interrupts == () and snap.values["refund"] == {"refunded": False, "status": "expired"}
    assert app.refunds.list(thread) == []


def test_duplicate_delivery_changes_nothing(harness, app, thread):
    op = pause(app, thread)
    harness.stack.answer(op["id"], "yes")
    done = harness.wait_state(op["id"], "succeeded")
    checkpoint = app.state(thread).config["configurable"]["checkpoint_id"]
    for _ in range(2):
        status, body = harness.replay(op["id"])
        assert status == 200 and body == done["result"]
    assert app.state(thread).config["configurable"]["checkpoint_id"] == checkpoint
    assert len(app.refunds.list(thread)) == 1


def test_another_operation_for_a_completed_interrupt_is_refused(harness, app, thread):
    op = pause(app, thread)
    harness.stack.answer(op["id"], "yes")
    harness.wait_state(op["id"], "succeeded")
    again = harness.client.enqueue(
        operation_key=f"{thread}:again",
        thread_id=thread,
        interrupt_id=op["interruptId"],
        effect="orders",
        external_id="user-1",
        question="Refund again?",
    )
    harness.stack.answer(again["id"], "yes")
    settled = harness.stack.wait_settled(again["id"])
    assert settled["state"] == "failed", settled
    assert settled["result"]["code"] == "interrupt_already_answered"
    assert len(app.refunds.list(thread)) == 1


def test_forged_delivery_is_refused(harness, app, thread):
    op = pause(app, thread)
    forged = harness.forged_approval(op)
    status, body = harness.forge(forged)
    assert status == 401 and body["code"] == "bad_signature"
    status, body = http_json("POST", harness.delivery_url, forged)
    assert status == 401 and body["code"] == "missing_header"
    assert [i.id for i in app.state(thread).interrupts] == [op["interruptId"]]
    assert app.refunds.list(thread) == []
    harness.stack.answer(op["id"], "no")
    harness.wait_state(op["id"], "denied")
    assert app.refunds.list(thread) == []


def test_worker_restarted_between_pause_and_answer(harness, app, thread):
    # Delivered straight to the worker (no proxy): a stopped worker refuses the connection.
    op = pause(app, thread, effect="orders_direct")
    harness.stack.decision_id(op["id"])
    harness.worker.kill()
    harness.stack.answer(op["id"], "yes")
    harness.stack.wait_failed_attempt(op["id"])
    assert app.refunds.list(thread) == []
    harness.worker.start()
    done = harness.wait_state(op["id"], "succeeded")
    [refund] = app.refunds.list(thread)
    assert refund["permit_id"] == done["permitId"]
    assert app.state(thread).interrupts == ()

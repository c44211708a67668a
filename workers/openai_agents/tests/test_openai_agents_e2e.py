"""OpenAI Agents SDK worker end to end: the run stops for approval in this
process, approvald and the sandbox run as child processes, the worker
restores the RunState and continues the run in its own process."""

import asyncio
import itertools

import pytest

from approvald_client.testing import http_json, wait_until

_n = itertools.count(1)


@pytest.fixture
def thread(request):
    return f"{request.node.name}-{next(_n)}"


def pause(app, thread, orders=(("o-1", 40.0, "EUR"),), **kw):
    op = asyncio.run(app.start(thread, list(orders), **kw))
    assert op is not None and op["interruptId"] == f"call_{thread}_0"
    snap = app.approvals.latest(thread)
    assert snap.seq == 1 and snap.pending_ids == [f"call_{thread}_{i}" for i in range(len(orders))]
    assert op["checkpointId"] == f"{thread}:1" and snap.consumed_by is None
    assert app.refunds.list(thread) == []
    return op


def test_approve_runs_the_tool_once(harness, app, thread):
    op = pause(app, thread)
    harness.stack.answer(op["id"], "yes")
    done = harness.wait_state(op["id"], "succeeded")
    [refund] = app.refunds.list(thread)
    assert refund["permit_id"] == done["permitId"] and refund["idempotency_key"] == done["idempotencyKey"]
    assert refund["call_id"] == op["interruptId"]
    assert done["result"]["finalOutput"] == "Refunded 40 EUR on order o-1."
    snap = app.approvals.latest(thread)
    assert snap.seq == 2 and snap.pending == [] and snap.final == "Refunded 40 EUR on order o-1."
    first, latest = app.approvals.snapshots(thread)
    assert first.consumed_by == op["id"] and latest.consumed_by is None


def test_deny_rejects_the_call(harness, app, thread):
    op = pause(app, thread)
    harness.stack.answer(op["id"], "no")
    done = harness.wait_state(op["id"], "denied")
    assert app.refunds.list(thread) == []
    assert done["result"]["finalOutput"] == "The tool call was not approved by a human (status: denied)."


def test_expiry_rejects_the_call(harness, app, thread):
    op = pause(app, thread, expires_in_seconds=2)
    done = harness.wait_state(op["id"], "expired")
    assert app.refunds.list(thread) == []
    assert done["result"]["finalOutput"] == "The tool call was not approved by a human (status: expired)."


def test_two_interruptions_are_asked_one_at_a_time_in_order(harness, app, thread):
    op1 = pause(app, thread, orders=(("o-1", 10.0, "EUR"), ("o-2", 20.0, "EUR")))
    assert [o["id"] for o in harness.client.list(thread_id=thread)] == [op1["id"]]
    harness.stack.answer(op1["id"], "yes")
    done1 = harness.wait_state(op1["id"], "succeeded")
    assert done1["result"]["pendingCallIds"] == [f"call_{thread}_1"]
    op2 = wait_until(
        lambda: next((o for o in harness.client.list(thread_id=thread) if o["id"] != op1["id"]), None),
        "the second question",
    )
    assert op2["interruptId"] == f"call_{thread}_1" and op2["checkpointId"] == f"{thread}:2"
    assert [r["order_id"] for r in app.refunds.list(thread)] == ["o-1"]
    harness.stack.answer(op2["id"], "no")
    done2 = harness.wait_state(op2["id"], "denied")
    assert done2["result"]["finalOutput"] == (
        "Refunded 10 EUR on order o-1. The tool call was not approved by a human (status: denied)."
    )
    assert [r["order_id"] for r in app.refunds.list(thread)] == ["o-1"]


def test_duplicate_delivery_changes_nothing(harness, app, thread):
    op = pause(app, thread)
    harness.stack.answer(op["id"], "yes")
    done = harness.wait_state(op["id"], "succeeded")
    for _ in range(2):
        status, body = harness.replay(op["id"])
        assert status == 200 and body == done["result"]
    assert app.approvals.latest(thread).seq == 2
    assert len(app.refunds.list(thread)) == 1


def test_a_second_operation_for_a_consumed_snapshot_is_refused(harness, app, thread):
    op = pause(app, thread, orders=(("o-1", 10.0, "EUR"), ("o-2", 20.0, "EUR")))
    harness.stack.answer(op["id"], "no")
    harness.wait_state(op["id"], "denied")
    # Asking again about the first call (already answered, its snapshot consumed).
    again = harness.client.enqueue(
        operation_key=f"{thread}:again",
        thread_id=thread,
        interrupt_id=op["interruptId"],
        effect="orders",
        external_id="user-1",
        question="Refund o-1 after all?",
    )
    harness.stack.answer(again["id"], "yes")
    settled = harness.stack.wait_settled(again["id"])
    assert settled["state"] == "failed" and settled["result"]["code"] == "interrupt_not_pending", settled
    assert app.refunds.list(thread) == []


def test_forged_delivery_is_refused(harness, app, thread):
    op = pause(app, thread)
    status, body = harness.forge(harness.forged_approval(op))
    assert status == 401 and body["code"] == "bad_signature"
    status, body = http_json("POST", harness.delivery_url, harness.forged_approval(op))
    assert status == 401 and body["code"] == "missing_header"
    snap = app.approvals.latest(thread)
    assert snap.seq == 1 and snap.consumed_by is None
    assert app.approvals.permit_for(thread, op["interruptId"]) is None
    assert app.refunds.list(thread) == []
    harness.stack.answer(op["id"], "no")
    harness.wait_state(op["id"], "denied")
    assert app.refunds.list(thread) == []


def test_worker_restarted_between_pause_and_answer(harness, app, thread):
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

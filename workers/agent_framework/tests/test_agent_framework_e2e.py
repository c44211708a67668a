"""Microsoft Agent Framework worker end to end: the workflow pauses in this
process, approvald and the sandbox run as child processes, the worker
restores the pause checkpoint in its own process and answers the request."""

import asyncio
import itertools
import json
import time

import pytest

from approval_types import SignedDelivery
from approvald_client import sign
from approvald_client.testing import http_json, new_webhook_secret

_n = itertools.count(1)


@pytest.fixture
def run_id(request):
    return f"{request.node.name}-{next(_n)}"


def pause(app, run_id, amount=40.0, **kw):
    op = asyncio.run(app.start(run_id, f"order-{run_id}", amount, "EUR", **kw))
    assert op is not None and op["interruptId"] == f"refund-{run_id}"
    [p] = app.approvals.pauses(run_id)
    assert op["checkpointId"] == p.checkpoint_id and p.consumed_by is None
    checkpoint = asyncio.run(app.storage.load(p.checkpoint_id))
    assert list(checkpoint.pending_request_info_events) == [op["interruptId"]]
    assert app.refunds.list(run_id) == []
    return op


def test_approve_runs_the_handler_once(harness, app, run_id):
    op = pause(app, run_id)
    harness.stack.answer(op["id"], "yes")
    done = harness.wait_state(op["id"], "succeeded")
    [refund] = app.refunds.list(run_id)
    assert refund["permit_id"] == done["permitId"] and refund["idempotency_key"] == done["idempotencyKey"]
    assert done["result"]["outputs"] == [{"refunded": True, "status": "approved", "permitId": done["permitId"]}]
    first, last = app.approvals.pauses(run_id)
    assert first.consumed_by == op["id"] and last.checkpoint_id is None and last.pending == []


def test_deny_answers_with_a_rejection(harness, app, run_id):
    op = pause(app, run_id)
    harness.stack.answer(op["id"], "no")
    done = harness.wait_state(op["id"], "denied")
    assert done["result"]["outputs"] == [{"refunded": False, "status": "denied"}]
    assert app.refunds.list(run_id) == []


def test_expiry_answers_with_a_rejection(harness, app, run_id):
    op = pause(app, run_id, expires_in_seconds=2)
    done = harness.wait_state(op["id"], "expired")
    assert done["result"]["outputs"] == [{"refunded": False, "status": "expired"}]
    assert app.refunds.list(run_id) == []


def test_duplicate_delivery_changes_nothing(harness, app, run_id):
    op = pause(app, run_id)
    harness.stack.answer(op["id"], "yes")
    done = harness.wait_state(op["id"], "succeeded")
    for _ in range(2):
        status, body = harness.replay(op["id"])
        assert status == 200 and body == done["result"]
    assert len(app.approvals.pauses(run_id)) == 2
    assert len(app.refunds.list(run_id)) == 1


def test_a_second_operation_cannot_replay_the_consumed_checkpoint(harness, app, run_id):
    op = pause(app, run_id)
    harness.stack.answer(op["id"], "no")
    harness.wait_state(op["id"], "denied")
    again = harness.client.enqueue(
        operation_key=f"{run_id}:again",
        thread_id=run_id,
        interrupt_id=op["interruptId"],
        checkpoint_id=op["checkpointId"],
        effect="orders",
        external_id="user-1",
        question="Refund after all?",
    )
    harness.stack.answer(again["id"], "yes")
    settled = harness.stack.wait_settled(again["id"])
    assert settled["state"] == "failed" and settled["result"]["code"] == "request_not_pending", settled
    assert app.refunds.list(run_id) == []


def test_forged_delivery_is_refused(harness, app, run_id):
    op = pause(app, run_id)
    status, body = harness.forge(harness.forged_approval(op))
    assert status == 401 and body["code"] == "bad_signature"
    status, body = http_json("POST", harness.delivery_url, harness.forged_approval(op))
    assert status == 401 and body["code"] == "missing_header"
    [p] = app.approvals.pauses(run_id)
    assert p.consumed_by is None and app.refunds.list(run_id) == []
    harness.stack.answer(op["id"], "yes")
    done = harness.wait_state(op["id"], "succeeded")
    assert [r["permit_id"] for r in app.refunds.list(run_id)] == [done["permitId"]]


def test_a_fabricated_approval_cannot_execute_the_handler(harness, app, run_id):
    """Someone restores the pause checkpoint directly (not through the worker)
    and answers with an approval that approvald did not sign: the response
    handler itself refuses, and nothing is refunded."""
    from refund_workflow import RefundWorkflowApp

    op = pause(app, run_id)
    # The worker's own executor, which holds the real secret.
    worker_side = RefundWorkflowApp(harness.data, harness.client, approver="user-1", secret=harness.stack.effect_secret)
    body = json.dumps(harness.forged_approval(op)).encode()
    ts = int(time.time())
    for headers in (
        {
            "webhook-id": "msg_x",
            "webhook-timestamp": str(ts),
            "webhook-signature": sign(new_webhook_secret(), "msg_x", ts, body),
        },
        {},
    ):
        result = asyncio.run(
            worker_side.build_workflow().run(
                checkpoint_id=op["checkpointId"], responses={op["interruptId"]: SignedDelivery(headers, body.decode())}
            )
        )
        assert result.get_outputs() == [{"refunded": False, "status": "refused_unverified"}]
    assert app.refunds.list(run_id) == []
    # The real answer, through approvald, still goes through.
    harness.stack.answer(op["id"], "yes")
    harness.wait_state(op["id"], "succeeded")
    assert len(app.refunds.list(run_id)) == 1


def test_worker_restarted_between_pause_and_answer(harness, app, run_id):
    op = pause(app, run_id, effect="orders_direct")
    harness.stack.decision_id(op["id"])
    harness.worker.kill()
    harness.stack.answer(op["id"], "yes")
    harness.stack.wait_failed_attempt(op["id"])
    assert app.refunds.list(run_id) == []
    harness.worker.start()
    done = harness.wait_state(op["id"], "succeeded")
    [refund] = app.refunds.list(run_id)
    assert refund["permit_id"] == done["permitId"]

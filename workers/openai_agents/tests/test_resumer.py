"""AgentsApprovals.handle without approvald: the snapshot compare-and-set,
and a run retried after a crash (the tool's write stays single)."""

import asyncio

import pytest

import approvald_openai_agents
from approvald_client import parse_delivery
from refund_agent import RefundAgentApp


class StubClient:
    def __init__(self):
        self.enqueued = []

    def enqueue(self, **fields):
        self.enqueued.append(fields)
        return {"id": f"op_{len(self.enqueued)}", "state": "enqueued", **fields}


def delivery(thread, call_id, *, op="op_1", key="idem-1", status="approved"):
    approved = status == "approved"
    return parse_delivery(
        {
            "operationId": op,
            "operationKey": f"{thread}:{call_id}",
            "threadId": thread,
            "interruptId": call_id,
            "checkpointId": f"{thread}:1",
            "decisionId": "dec",
            "correlationId": "dec",
            "type": "confirm",
            "status": status,
            "approved": approved,
            "answer": "yes" if approved else "no",
            "permitId": "prm_1" if approved else None,
            "idempotencyKey": key,
            "revision": None,
            "subject": {"externalId": "u"},
            "deadline": "2099-01-01T00:00:00.000Z",
        }
    )


@pytest.fixture
def app(tmp_path):
    return RefundAgentApp(tmp_path, StubClient(), approver="user-1")


def test_pause_enqueues_only_the_first_call(app):
    asyncio.run(app.start("t", [("o-1", 1.0, "EUR"), ("o-2", 2.0, "EUR")]))
    [fields] = app.approvals.client.enqueued
    assert fields["interrupt_id"] == "call_t_0" and fields["operation_key"] == "t:call_t_0"
    assert fields["tool_name"] == "refund"
    assert fields["parameters"] == {"order_id": "o-1", "amount": 1.0, "currency": "EUR"}


def test_a_snapshot_is_resumed_by_one_operation_only(app):
    asyncio.run(app.start("t", [("o-1", 1.0, "EUR"), ("o-2", 2.0, "EUR")]))
    assert app.approvals.handle(delivery("t", "call_t_0", status="denied"))[0] == 200
    # A second operation about the same (now answered) call: refused.
    status, body = app.approvals.handle(delivery("t", "call_t_0", op="op_2", key="idem-2"))
    assert status == 409 and body["code"] == "interrupt_not_pending"
    first = app.approvals.snapshots("t")[0]
    assert first.consumed_by == "op_1"
    assert app.refunds.list("t") == []


def test_a_run_retried_after_a_crash_writes_once(app, monkeypatch):
    asyncio.run(app.start("t", [("o-1", 1.0, "EUR")]))
    status, body = app.approvals.handle(delivery("t", "call_t_0"))
    assert status == 200 and body["finalOutput"] == "Refunded 1 EUR on order o-1."
    # Undo what the commit after the run recorded: as if the worker died
    # after the tool ran and before it stored the new snapshot and answer.
    with app.approvals._db() as db:
        db.execute("DELETE FROM agent_snapshots WHERE thread_id = 't' AND seq = 2")
        db.execute("DELETE FROM agent_deliveries WHERE idempotency_key = 'idem-1'")
    # The same operation is delivered again: it may re-claim its snapshot.
    assert app.approvals.handle(delivery("t", "call_t_0")) == (200, body)
    assert len(app.refunds.list("t")) == 1
    # Another operation may not.
    with app.approvals._db() as db:
        db.execute("DELETE FROM agent_snapshots WHERE thread_id = 't' AND seq = 2")
    status, body = app.approvals.handle(delivery("t", "call_t_0", op="op_9", key="idem-9"))
    assert status == 409 and body["code"] == "snapshot_consumed"
    assert len(app.refunds.list("t")) == 1


def test_a_failed_run_is_retried(app, monkeypatch):
    asyncio.run(app.start("t", [("o-1", 1.0, "EUR")]))
    real = approvald_openai_agents.Runner.run
    calls = []

    async def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("the model is unreachable")
        return await real(*args, **kwargs)

    monkeypatch.setattr(approvald_openai_agents.Runner, "run", flaky)
    with pytest.raises(ConnectionError):  # answered 500: approvald retries
        app.approvals.handle(delivery("t", "call_t_0"))
    assert app.refunds.list("t") == []
    assert app.approvals.handle(delivery("t", "call_t_0"))[0] == 200
    assert len(app.refunds.list("t")) == 1


def test_the_tool_refuses_without_a_grant(app):
    """If the SDK ran the tool for a call approvald never approved (e.g. a
    stale snapshot approved by hand), the tool itself refuses to write."""
    from agents import RunState, Runner

    asyncio.run(app.start("t", [("o-1", 1.0, "EUR")]))
    snap = app.approvals.latest("t")

    async def approve_by_hand():
        agent = app.build_agent(__import__("refund_agent").resume_model())
        state = await RunState.from_string(agent, snap.state)
        [item] = state.get_interruptions()
        state.approve(item)
        return await Runner.run(agent, state)

    result = asyncio.run(approve_by_hand())
    assert result.final_output == "Refusing to refund order o-1: no approval on record."
    assert app.refunds.list("t") == []

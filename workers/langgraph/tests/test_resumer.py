"""LangGraphApprovals.handle without approvald: pending checks, the ledger,
and a resume whose protected write fails once (approvald would retry)."""

import sqlite3

import pytest
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import interrupt
from typing_extensions import TypedDict

from approvald_client import parse_delivery
from approvald_client.client import ApprovaldClient
from approvald_langgraph import LangGraphApprovals, approval_request, grants_permission


class S(TypedDict, total=False):
    approval: dict
    done: bool


def make(tmp_path, failures):
    writes = []

    def ask(state):
        return {"approval": interrupt(approval_request("Write?", tool_name="write"))}

    def write(state):
        if grants_permission(state["approval"]):
            if failures:
                failures.pop()
                raise RuntimeError("the database is down")
            writes.append(state["approval"]["idempotencyKey"])
        return {"done": True}

    g = StateGraph(S)
    g.add_node("ask", ask)
    g.add_node("write", write)
    g.add_edge(START, "ask")
    g.add_edge("ask", "write")
    g.add_edge("write", END)
    graph = g.compile(checkpointer=SqliteSaver(sqlite3.connect(tmp_path / "cp.db", check_same_thread=False)))
    approvals = LangGraphApprovals(
        graph,
        ApprovaldClient("http://127.0.0.1:9", "unused-token-0123456789"),
        effect="orders",
        ledger_path=str(tmp_path / "ledger.db"),
        summarize=lambda v: {"done": v.get("done", False)},
    )
    return graph, approvals, writes


def delivery(thread, interrupt_id, *, op="op_1", key="idem-1", status="approved"):
    approved = status == "approved"
    return parse_delivery(
        {
            "operationId": op,
            "operationKey": f"{thread}:{interrupt_id}",
            "threadId": thread,
            "interruptId": interrupt_id,
            "checkpointId": None,
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


def paused(graph, thread):
    cfg = {"configurable": {"thread_id": thread}}
    graph.invoke({}, cfg)
    [intr] = graph.get_state(cfg).interrupts
    return intr.id


def test_a_failed_resume_is_continued_by_the_retry(tmp_path):
    graph, approvals, writes = make(tmp_path, failures=[1])
    iid = paused(graph, "t")
    with pytest.raises(RuntimeError):  # the receiver answers 500: approvald retries
        approvals.handle(delivery("t", iid))
    assert writes == []
    assert graph.get_state({"configurable": {"thread_id": "t"}}).interrupts == ()
    status, body = approvals.handle(delivery("t", iid))
    assert status == 200 and body["result"] == {"done": True}
    assert writes == ["idem-1"]
    assert approvals.handle(delivery("t", iid)) == (200, body)
    assert writes == ["idem-1"]


def test_unknown_or_wrong_interrupt_is_refused(tmp_path):
    graph, approvals, writes = make(tmp_path, failures=[])
    iid = paused(graph, "t")
    assert approvals.handle(delivery("t", "0" * 32))[0] == 409
    assert approvals.handle(delivery("nope", iid))[0] == 409
    assert [i.id for i in graph.get_state({"configurable": {"thread_id": "t"}}).interrupts] == [iid]
    assert writes == []


def test_a_second_operation_cannot_resume_a_claimed_interrupt(tmp_path):
    graph, approvals, writes = make(tmp_path, failures=[])
    iid = paused(graph, "t")
    assert approvals.handle(delivery("t", iid, status="denied"))[0] == 200
    status, body = approvals.handle(delivery("t", iid, op="op_2", key="idem-2"))
    assert status == 409 and body["code"] == "interrupt_already_answered"
    assert writes == []


def test_a_resume_value_without_permit_grants_nothing():
    assert not grants_permission({"status": "approved", "approved": True, "permitId": None, "idempotencyKey": "k"})
    assert not grants_permission({"status": "denied", "approved": True, "permitId": "p", "idempotencyKey": "k"})
    assert not grants_permission("yes")
    assert grants_permission({"status": "approved", "approved": True, "permitId": "p", "idempotencyKey": "k"})

"""Example application: a LangGraph refund flow whose refund (the protected
write) waits for a human's approval through approvald.

    prepare ──▶ approve (interrupt) ──▶ refund (protected write) ──▶ END

Run the worker (the effect target approvald delivers to):

    python refund_graph.py serve --data ./data --port 8092

(APPROVALD_URL, APPROVALD_TOKEN and APPROVALD_EFFECT_SECRET from the environment.)
"""

from __future__ import annotations

import argparse
import logging
import os
import sqlite3
import time
from contextlib import closing
from pathlib import Path
from typing import Any, TypedDict

from approvald_client import ApprovaldClient
from approvald_client.receiver import DeliveryServer, signed
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import interrupt

from approvald_langgraph import LangGraphApprovals, approval_request, grants_permission


class RefundState(TypedDict, total=False):
    order_id: str
    amount: float
    currency: str
    approval: dict
    refund: dict


class Refunds:
    """The application's own database: refunds, at most one per idempotency key."""

    def __init__(self, path: str):
        self.path = path
        with closing(self._db()) as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS refunds (idempotency_key TEXT PRIMARY KEY, thread_id TEXT NOT NULL,"
                " order_id TEXT NOT NULL, amount REAL NOT NULL, currency TEXT NOT NULL, permit_id TEXT NOT NULL,"
                " created_at REAL NOT NULL)"
            )

    def _db(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        return db

    def refund_once(
        self, *, idempotency_key: str, thread_id: str, order_id: str, amount: float, currency: str, permit_id: str
    ) -> None:
        with closing(self._db()) as db:
            db.execute(
                "INSERT INTO refunds VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (idempotency_key) DO NOTHING",
                (idempotency_key, thread_id, order_id, amount, currency, permit_id, time.time()),
            )

    def list(self, thread_id: str | None = None) -> list[dict]:
        with closing(self._db()) as db:
            db.row_factory = sqlite3.Row
            if thread_id is None:
                return [dict(r) for r in db.execute("SELECT * FROM refunds")]
            return [dict(r) for r in db.execute("SELECT * FROM refunds WHERE thread_id = ?", (thread_id,))]


def build_graph(checkpoints_path: str, refunds: Refunds) -> Any:
    def prepare(state: RefundState) -> dict:
        # Pure: runs again on resume only if it had not completed.
        return {"amount": round(float(state["amount"]), 2), "currency": state.get("currency", "EUR")}

    def approve(state: RefundState) -> dict:
        # Nothing with side effects before interrupt(): this code re-runs on resume.
        value = interrupt(
            approval_request(
                f"Refund {state['amount']:g} {state['currency']} on order {state['order_id']}?",
                tool_name="refund",
                tool_target=state["order_id"],
                parameters={"amount": state["amount"], "currency": state["currency"]},
            )
        )
        return {"approval": value}

    def refund(state: RefundState, config: RunnableConfig) -> dict:
        approval = state["approval"]
        if not grants_permission(approval):
            return {
                "refund": {"refunded": False, "status": approval.get("status") if isinstance(approval, dict) else None}
            }
        refunds.refund_once(
            idempotency_key=approval["idempotencyKey"],
            thread_id=config["configurable"]["thread_id"],
            order_id=state["order_id"],
            amount=state["amount"],
            currency=state["currency"],
            permit_id=approval["permitId"],
        )
        return {"refund": {"refunded": True, "status": "approved", "permitId": approval["permitId"]}}

    g = StateGraph(RefundState)
    g.add_node("prepare", prepare)
    g.add_node("approve", approve)
    g.add_node("refund", refund)
    g.add_edge(START, "prepare")
    g.add_edge("prepare", "approve")
    g.add_edge("approve", "refund")
    g.add_edge("refund", END)
    saver = SqliteSaver(sqlite3.connect(checkpoints_path, check_same_thread=False))
    return g.compile(checkpointer=saver)


class RefundApp:
    """Everything the application and the worker share, under one data folder."""

    def __init__(self, data_dir: str | Path, client: ApprovaldClient, effect: str = "orders"):
        data = Path(data_dir)
        data.mkdir(parents=True, exist_ok=True)
        self.refunds = Refunds(str(data / "refunds.db"))
        self.graph = build_graph(str(data / "checkpoints.db"), self.refunds)
        self.approvals = LangGraphApprovals(
            self.graph,
            client,
            effect=effect,
            ledger_path=str(data / "approvals.db"),
            summarize=lambda values: values.get("refund"),
        )

    def start_refund(
        self,
        thread_id: str,
        order_id: str,
        amount: float,
        currency: str,
        *,
        approver: str,
        expires_in_seconds: int | None = None,
        effect: str | None = None,
    ) -> list[dict]:
        """Runs the graph until it pauses, then asks approvald for the approval."""
        self.graph.invoke(
            {"order_id": order_id, "amount": amount, "currency": currency}, {"configurable": {"thread_id": thread_id}}
        )
        return self.approvals.request_approvals(
            thread_id, external_id=approver, expires_in_seconds=expires_in_seconds, effect=effect
        )

    def state(self, thread_id: str) -> Any:
        return self.graph.get_state({"configurable": {"thread_id": thread_id}})


def client_from_env() -> ApprovaldClient:
    return ApprovaldClient(os.environ.get("APPROVALD_URL", "http://127.0.0.1:8080"), os.environ["APPROVALD_TOKEN"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve the effect target")
    s.add_argument("--data", required=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8092)
    s.add_argument("--effect", default="orders")
    r = sub.add_parser("start", help="start a refund and ask for its approval")
    r.add_argument("--data", required=True)
    r.add_argument("--effect", default="orders")
    r.add_argument("thread_id")
    r.add_argument("order_id")
    r.add_argument("amount", type=float)
    r.add_argument("--currency", default="EUR")
    r.add_argument("--approver", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = RefundApp(args.data, client_from_env(), effect=args.effect)
    if args.cmd == "serve":
        server = DeliveryServer(
            signed(os.environ["APPROVALD_EFFECT_SECRET"], app.approvals.handle), args.host, args.port
        )
        logging.info("LangGraph refund worker on %s", server.url)
        server.serve_forever()
    else:
        for op in app.start_refund(args.thread_id, args.order_id, args.amount, args.currency, approver=args.approver):
            print(op["id"], op["state"], op["interruptId"])


if __name__ == "__main__":
    main()

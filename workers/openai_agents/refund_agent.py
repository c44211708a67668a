"""Example application: an OpenAI Agents SDK agent whose ``refund`` tool
needs a human's approval, asked through approvald.

The model here is the SDK's scripted fake model (``agents.testing``), so the
example runs offline with no model calls: on start it asks for one refund
call per order; after the tools ran it summarizes their outputs. Replace
``start_model``/``resume_model`` with your real model.

Run the worker (the effect target approvald delivers to):

    python refund_agent.py serve --data ./data --port 8093 --approver user-1

(APPROVALD_URL, APPROVALD_TOKEN and APPROVALD_EFFECT_SECRET from the environment.)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sqlite3
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from agents import Agent, Model, Runner, function_tool, set_tracing_disabled
from agents.testing import ModelCall, ModelStep, ScriptedModel, assistant_message, function_call
from agents.tool_context import ToolContext
from approvald_client import ApprovaldClient
from approvald_client.receiver import DeliveryServer, signed

from approvald_openai_agents import AgentsApprovals

set_tracing_disabled(True)

AGENT_NAME = "refund-agent"


class Refunds:
    """The application's own database: refunds, at most one per idempotency key."""

    def __init__(self, path: str):
        self.path = path
        with closing(self._db()) as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS refunds (idempotency_key TEXT PRIMARY KEY, thread_id TEXT NOT NULL,"
                " call_id TEXT NOT NULL, order_id TEXT NOT NULL, amount REAL NOT NULL, currency TEXT NOT NULL,"
                " permit_id TEXT NOT NULL, created_at REAL NOT NULL)"
            )

    def _db(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        return db

    def refund_once(self, **row: Any) -> None:
        with closing(self._db()) as db:
            db.execute(
                "INSERT INTO refunds VALUES (:idempotency_key, :thread_id, :call_id, :order_id, :amount, :currency,"
                " :permit_id, :created_at) ON CONFLICT (idempotency_key) DO NOTHING",
                {**row, "created_at": time.time()},
            )

    def list(self, thread_id: str) -> list[dict]:
        with closing(self._db()) as db:
            db.row_factory = sqlite3.Row
            return [
                dict(r)
                for r in db.execute("SELECT * FROM refunds WHERE thread_id = ? ORDER BY created_at", (thread_id,))
            ]


def start_model(orders: list[tuple[str, float, str]], thread_id: str) -> Model:
    """The fake model's first turn: one refund call per order."""
    calls = [
        function_call("refund", {"order_id": o, "amount": a, "currency": c}, call_id=f"call_{thread_id}_{i}")
        for i, (o, a, c) in enumerate(orders)
    ]
    return ScriptedModel([ModelStep(output=calls)])


def _summarize(call: ModelCall) -> list:
    outputs = [i.get("output") for i in call.input if isinstance(i, dict) and i.get("type") == "function_call_output"]
    return [assistant_message(" ".join(str(o) for o in outputs))]


def resume_model() -> Model:
    """The fake model's turn after the tools ran: a summary of their outputs."""
    return ScriptedModel([ModelStep(responder=_summarize)])


class RefundAgentApp:
    def __init__(self, data_dir: str | Path, client: ApprovaldClient, *, approver: str, effect: str = "orders"):
        data = Path(data_dir)
        data.mkdir(parents=True, exist_ok=True)
        self.refunds = Refunds(str(data / "refunds.db"))
        self.approvals = AgentsApprovals(
            client,
            effect=effect,
            db_path=str(data / "runs.db"),
            external_id=approver,
            build_agent=lambda: self.build_agent(resume_model()),
            question=lambda call: f"Allow the agent to {call.name} {call.arguments}?",
        )

    def build_agent(self, model: Model) -> Agent:
        @function_tool(needs_approval=True)
        def refund(ctx: ToolContext, order_id: str, amount: float, currency: str) -> str:
            """Refund an order."""
            thread_id = ctx.context["thread_id"]
            grant = self.approvals.permit_for(thread_id, ctx.tool_call_id)
            if grant is None:  # the SDK ran it without approvald's permit: refuse
                return f"Refusing to refund order {order_id}: no approval on record."
            self.refunds.refund_once(
                idempotency_key=grant.idempotency_key,
                thread_id=thread_id,
                call_id=ctx.tool_call_id,
                order_id=order_id,
                amount=amount,
                currency=currency,
                permit_id=grant.permit_id,
            )
            return f"Refunded {amount:g} {currency} on order {order_id}."

        return Agent(name=AGENT_NAME, instructions="Refund what the customer asks for.", tools=[refund], model=model)

    async def start(
        self,
        thread_id: str,
        orders: list[tuple[str, float, str]],
        *,
        expires_in_seconds: int | None = None,
        effect: str | None = None,
    ) -> dict | None:
        """Runs the agent until it stops for approvals, stores the run and asks
        approvald about its first pending tool call."""
        agent = self.build_agent(start_model(orders, thread_id))
        result = await Runner.run(agent, f"Refund orders {orders}", context={"thread_id": thread_id})
        return self.approvals.save_pause(thread_id, result, effect=effect, expires_in_seconds=expires_in_seconds)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve the effect target")
    s.add_argument("--data", required=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8093)
    s.add_argument("--approver", required=True)
    s.add_argument("--effect", default="orders")
    r = sub.add_parser("start", help="start a run that asks to refund ORDER:AMOUNT:CURRENCY ...")
    r.add_argument("--data", required=True)
    r.add_argument("--approver", required=True)
    r.add_argument("--effect", default="orders")
    r.add_argument("thread_id")
    r.add_argument("orders", nargs="+")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    client = ApprovaldClient(os.environ.get("APPROVALD_URL", "http://127.0.0.1:8080"), os.environ["APPROVALD_TOKEN"])
    app = RefundAgentApp(args.data, client, approver=args.approver, effect=args.effect)
    if args.cmd == "serve":
        server = DeliveryServer(
            signed(os.environ["APPROVALD_EFFECT_SECRET"], app.approvals.handle), args.host, args.port
        )
        logging.info("OpenAI Agents refund worker on %s", server.url)
        server.serve_forever()
    else:
        orders = [(o, float(a), c) for o, a, c in (x.split(":") for x in args.orders)]
        op = asyncio.run(app.start(args.thread_id, orders))
        print(op["id"] if op else "the run finished without asking for approval")


if __name__ == "__main__":
    main()

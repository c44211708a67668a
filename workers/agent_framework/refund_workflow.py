"""Example application: a Microsoft Agent Framework workflow whose refund
(the protected action) waits for a human's approval through approvald.

``RefundExecutor`` asks with ``ctx.request_info(FunctionApprovalRequest(...),
SignedDelivery)`` and pauses; its response handler refunds only when the
answer is approvald's signed delivery of an ``approved`` confirm for exactly
this request, and then with the delivery's idempotency key.

The worker's command line is in ``worker.py`` (types used in checkpoints must
not live in ``__main__``).
"""

from __future__ import annotations

import sqlite3
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from agent_framework import (
    Executor,
    FileCheckpointStorage,
    Workflow,
    WorkflowBuilder,
    WorkflowContext,
    handler,
    response_handler,
)
from approvald_client import ApprovaldClient
from typing_extensions import Never

from approval_types import CHECKPOINT_TYPES, FunctionApprovalRequest, SignedDelivery
from approvald_agent_framework import WorkflowApprovals, verified

WORKFLOW_NAME = "refunds"


class Refunds:
    """The application's own database: refunds, at most one per idempotency key."""

    def __init__(self, path: str):
        self.path = path
        with closing(self._db()) as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS refunds (idempotency_key TEXT PRIMARY KEY, run_id TEXT NOT NULL,"
                " order_id TEXT NOT NULL, amount REAL NOT NULL, currency TEXT NOT NULL, permit_id TEXT NOT NULL,"
                " created_at REAL NOT NULL)"
            )

    def _db(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        return db

    def refund_once(self, **row: Any) -> None:
        with closing(self._db()) as db:
            db.execute(
                "INSERT INTO refunds VALUES (:idempotency_key, :run_id, :order_id, :amount, :currency, :permit_id,"
                " :created_at) ON CONFLICT (idempotency_key) DO NOTHING",
                {**row, "created_at": time.time()},
            )

    def list(self, run_id: str) -> list[dict]:
        with closing(self._db()) as db:
            db.row_factory = sqlite3.Row
            return [dict(r) for r in db.execute("SELECT * FROM refunds WHERE run_id = ?", (run_id,))]


class RefundExecutor(Executor):
    def __init__(self, refunds: Refunds, secret: str | None):
        super().__init__(id="refund")
        self.refunds = refunds
        self.secret = secret

    @handler
    async def start(self, order: dict, ctx: WorkflowContext) -> None:
        # Nothing with side effects here: only ask.
        request = FunctionApprovalRequest(
            request_id=f"refund-{order['run_id']}",
            function_name="refund",
            arguments={"order_id": order["order_id"], "amount": order["amount"], "currency": order["currency"]},
            question=f"Refund {order['amount']:g} {order['currency']} on order {order['order_id']}?",
        )
        await ctx.request_info(request, SignedDelivery, request_id=request.request_id)

    @response_handler
    async def on_decision(
        self, original: FunctionApprovalRequest, answer: SignedDelivery, ctx: WorkflowContext[Never, dict]
    ) -> None:
        d = verified(self.secret, answer, original)
        if d is None:  # not approvald's signed answer to this request: nothing runs
            await ctx.yield_output({"refunded": False, "status": "refused_unverified"})
            return
        if not d.grants_permission:
            await ctx.yield_output({"refunded": False, "status": d.status})
            return
        run_id = original.request_id.removeprefix("refund-")
        self.refunds.refund_once(
            idempotency_key=d.idempotency_key,
            run_id=run_id,
            order_id=original.arguments["order_id"],
            amount=original.arguments["amount"],
            currency=original.arguments["currency"],
            permit_id=d.permit_id,
        )
        await ctx.yield_output({"refunded": True, "status": "approved", "permitId": d.permit_id})


class RefundWorkflowApp:
    def __init__(
        self,
        data_dir: str | Path,
        client: ApprovaldClient,
        *,
        approver: str,
        secret: str | None = None,
        effect: str = "orders",
    ):
        data = Path(data_dir)
        data.mkdir(parents=True, exist_ok=True)
        self.refunds = Refunds(str(data / "refunds.db"))
        self.storage = FileCheckpointStorage(data / "checkpoints", allowed_checkpoint_types=CHECKPOINT_TYPES)
        self.secret = secret
        self.approvals = WorkflowApprovals(
            client,
            effect=effect,
            db_path=str(data / "runs.db"),
            secret=secret,
            storage=self.storage,
            build_workflow=self.build_workflow,
            external_id=approver,
        )

    def build_workflow(self) -> Workflow:
        return WorkflowBuilder(
            name=WORKFLOW_NAME,
            start_executor=RefundExecutor(self.refunds, self.secret),
            checkpoint_storage=self.storage,
        ).build()

    async def start(
        self,
        run_id: str,
        order_id: str,
        amount: float,
        currency: str,
        *,
        expires_in_seconds: int | None = None,
        effect: str | None = None,
    ) -> dict | None:
        """Runs the workflow until it pauses for approval, records the pause
        checkpoint and asks approvald."""
        workflow = self.build_workflow()
        result = await workflow.run({"run_id": run_id, "order_id": order_id, "amount": amount, "currency": currency})
        return await self.approvals.save_pause(
            run_id, workflow, result, effect=effect, expires_in_seconds=expires_in_seconds
        )

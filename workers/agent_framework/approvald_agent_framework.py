"""Resume Microsoft Agent Framework workflows with approvald's decisions.

An executor pauses with ``ctx.request_info(FunctionApprovalRequest(...),
SignedDelivery, request_id=...)``; the workflow's ``FileCheckpointStorage``
(with ``allowed_checkpoint_types=CHECKPOINT_TYPES``) keeps the pause
checkpoint. ``WorkflowApprovals.save_pause(run_id, workflow, result)`` records
that checkpoint for the run and enqueues an approvald operation for the first
pending request (operation key ``<run_id>:<request_id>``, ``interruptId`` =
the request id, ``checkpointId`` = the pause checkpoint id).

When approvald delivers the outcome, ``handle_request(headers, body)``:

1. verifies the Standard Webhooks signature (``401`` otherwise);
2. answers a repeat of an already handled delivery with the stored answer;
3. checks that the run's latest pause is that checkpoint and that this
   request is pending in it (in the record and in the loaded checkpoint);
4. marks the pause checkpoint consumed by this operation (compare-and-set):
   replaying a pause checkpoint would run the response handler again;
5. restores the checkpoint in a fresh workflow object and answers the
   request with the ``SignedDelivery`` itself, so that the response handler
   verifies the signature again before it acts: a fabricated answer that
   did not come through approvald cannot run the protected action, whoever
   calls ``workflow.run``;
6. records the next pause (or the end) with its answer, and enqueues the next
   pending request, if any.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import closing
from dataclasses import asdict, dataclass
from typing import Any

from agent_framework import FileCheckpointStorage, Workflow
from approval_types import FunctionApprovalRequest, SignedDelivery
from approvald_client import ApprovaldClient, Delivery, InvalidDelivery, verify_delivery

log = logging.getLogger("approvald_agent_framework")

SCHEMA = """
CREATE TABLE IF NOT EXISTS workflow_pauses (
    run_id        TEXT NOT NULL,
    seq           INTEGER NOT NULL,
    checkpoint_id TEXT,                -- the pause checkpoint; NULL once the run ended
    pending       TEXT NOT NULL,       -- JSON list of pending approval requests, in order
    outputs       TEXT,                -- JSON outputs of the step that led here
    consumed_by   TEXT,                -- the operation that resumed this checkpoint
    created_at    REAL NOT NULL,
    PRIMARY KEY (run_id, seq)
);
CREATE TABLE IF NOT EXISTS workflow_deliveries (
    idempotency_key TEXT PRIMARY KEY,
    operation_id    TEXT NOT NULL,
    run_id          TEXT NOT NULL,
    request_id      TEXT NOT NULL,
    response        TEXT NOT NULL
);
"""

SIGNATURE_HEADERS = ("webhook-id", "webhook-timestamp", "webhook-signature")


@dataclass(frozen=True)
class Pause:
    run_id: str
    seq: int
    checkpoint_id: str | None
    pending: list[FunctionApprovalRequest]
    outputs: Any
    consumed_by: str | None

    @property
    def pending_ids(self) -> list[str]:
        return [p.request_id for p in self.pending]


def signed_delivery(headers: Mapping[str, str], body: bytes | str) -> SignedDelivery:
    lower = {k.lower(): v for k, v in headers.items()}
    return SignedDelivery(
        headers={k: lower[k] for k in SIGNATURE_HEADERS if k in lower},
        body=body.decode("utf-8") if isinstance(body, bytes) else body,
    )


def verified(secret: str | None, answer: Any, request: FunctionApprovalRequest) -> Delivery | None:
    """For response handlers: the delivery ``answer`` carries, if approvald
    signed it for exactly this request; ``None`` otherwise."""
    if secret is None or not isinstance(answer, SignedDelivery):
        return None
    try:
        d = verify_delivery(secret, answer.headers, answer.body)
    except (InvalidDelivery, ValueError) as e:
        log.warning("refusing an answer to %s: %s", request.request_id, e)
        return None
    if d.interrupt_id != request.request_id:
        log.warning("refusing an answer for %s given to %s", d.interrupt_id, request.request_id)
        return None
    return d


def _flat_parameters(arguments: Mapping[str, Any]) -> dict | None:
    if len(arguments) > 32:
        return None
    for k, v in arguments.items():
        if not isinstance(k, str) or not (1 <= len(k) <= 64) or not isinstance(v, (str, int, float, bool)):
            return None
        if isinstance(v, str) and len(v) > 200:
            return None
    return dict(arguments)


class WorkflowApprovals:
    def __init__(
        self,
        client: ApprovaldClient,
        *,
        effect: str,
        db_path: str,
        secret: str | None,
        storage: FileCheckpointStorage,
        build_workflow: Callable[[], Workflow],
        external_id: str,
        expires_in_seconds: int | None = None,
    ):
        """``build_workflow()`` returns a fresh workflow with the same name,
        executor ids and shape, on ``storage``; ``secret`` is the effect
        target's ``whsec_`` secret; ``external_id`` the Pushary recipient."""
        self.client = client
        self.effect = effect
        self.db_path = db_path
        self.secret = secret
        self.storage = storage
        self.build_workflow = build_workflow
        self.external_id = external_id
        self.expires_in_seconds = expires_in_seconds
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        with closing(self._db()) as db:
            db.executescript(SCHEMA)

    # -- the application side ---------------------------------------------

    async def save_pause(
        self,
        run_id: str,
        workflow: Workflow,
        result: Any,
        *,
        effect: str | None = None,
        expires_in_seconds: int | None = None,
    ) -> dict | None:
        """Records the pause checkpoint of a run that stopped with approval
        requests and asks approvald about the first. ``None`` if it did not."""
        pending = [e.data for e in result.get_request_info_events() if isinstance(e.data, FunctionApprovalRequest)]
        if not pending:
            return None
        checkpoint_id = await self._pause_checkpoint(workflow, pending)
        self._insert_pause(run_id, checkpoint_id, pending, None)
        return self.enqueue_next(run_id, effect=effect, expires_in_seconds=expires_in_seconds)

    def enqueue_next(
        self, run_id: str, *, effect: str | None = None, expires_in_seconds: int | None = None
    ) -> dict | None:
        pause = self.latest(run_id)
        if pause is None or not pause.pending or pause.consumed_by is not None:
            return None
        req = pause.pending[0]
        return self.client.enqueue(
            operation_key=f"{run_id}:{req.request_id}",
            thread_id=run_id,
            interrupt_id=req.request_id,
            checkpoint_id=pause.checkpoint_id,
            effect=effect or self.effect,
            external_id=self.external_id,
            question=req.question[:500],
            tool_name=req.function_name,
            parameters=_flat_parameters(req.arguments),
            expires_in_seconds=expires_in_seconds or self.expires_in_seconds,
        )

    def latest(self, run_id: str) -> Pause | None:
        pauses = self.pauses(run_id)
        return pauses[-1] if pauses else None

    def pauses(self, run_id: str) -> list[Pause]:
        with closing(self._db()) as db:
            rows = db.execute(
                "SELECT run_id, seq, checkpoint_id, pending, outputs, consumed_by FROM workflow_pauses"
                " WHERE run_id = ? ORDER BY seq",
                (run_id,),
            ).fetchall()
        return [
            Pause(
                r[0],
                r[1],
                r[2],
                [FunctionApprovalRequest(**p) for p in json.loads(r[3])],
                json.loads(r[4]) if r[4] else None,
                r[5],
            )
            for r in rows
        ]

    # -- the effect target ---------------------------------------------------

    def handle_request(self, headers: Mapping[str, str], body: bytes) -> tuple[int, Any]:
        """For ``approvald_client.receiver.DeliveryServer``: verify, then resume."""
        if self.secret is None:
            raise RuntimeError("WorkflowApprovals needs the effect secret to receive deliveries")
        try:
            d = verify_delivery(self.secret, headers, body)
        except InvalidDelivery as e:
            log.warning("refused a delivery: %s", e)
            return 401, {"code": e.reason, "detail": e.detail}
        with self._lock(d.thread_id):
            return asyncio.run(self._handle(d, signed_delivery(headers, body)))

    async def _handle(self, d: Delivery, answer: SignedDelivery) -> tuple[int, Any]:
        with closing(self._db()) as db:
            row = db.execute(
                "SELECT response FROM workflow_deliveries WHERE idempotency_key = ?", (d.idempotency_key,)
            ).fetchone()
        if row is not None:
            self.enqueue_next(d.thread_id)  # in case a crash came between the two
            return 200, json.loads(row[0])

        pause = self.latest(d.thread_id)
        if pause is None or d.interrupt_id not in pause.pending_ids:
            return 409, _err("request_not_pending", "the run's latest pause has no such pending request")
        if d.checkpoint_id is not None and d.checkpoint_id != pause.checkpoint_id:
            return 409, _err("checkpoint_mismatch", "the request is pending in another checkpoint")
        with closing(self._db()) as db:
            db.execute("BEGIN IMMEDIATE")
            claimed = db.execute(
                "UPDATE workflow_pauses SET consumed_by = ? WHERE run_id = ? AND seq = ?"
                " AND (consumed_by IS NULL OR consumed_by = ?)",
                (d.operation_id, d.thread_id, pause.seq, d.operation_id),
            ).rowcount
            db.execute("COMMIT" if claimed == 1 else "ROLLBACK")
        if claimed != 1:
            return 409, _err("checkpoint_consumed", "another operation already resumed this checkpoint")

        checkpoint = await self.storage.load(pause.checkpoint_id)
        if d.interrupt_id not in checkpoint.pending_request_info_events:
            return 409, _err("request_not_pending", "the checkpoint has no such pending request")
        workflow = self.build_workflow()
        log.info("resuming run %s request %s with %s", d.thread_id, d.interrupt_id, d.status)
        result = await workflow.run(checkpoint_id=pause.checkpoint_id, responses={d.interrupt_id: answer})

        outputs = [
            o if isinstance(o, (dict, list, str, int, float, bool, type(None))) else str(o)
            for o in result.get_outputs()
        ]
        pending = [e.data for e in result.get_request_info_events() if isinstance(e.data, FunctionApprovalRequest)]
        next_checkpoint = await self._pause_checkpoint(workflow, pending) if pending else None
        response = {
            "runId": d.thread_id,
            "requestId": d.interrupt_id,
            "status": d.status,
            "outputs": outputs,
            "pendingRequestIds": [p.request_id for p in pending],
        }
        with closing(self._db()) as db:
            db.execute("BEGIN IMMEDIATE")
            self._insert_pause(d.thread_id, next_checkpoint, pending, outputs, db=db)
            db.execute(
                "INSERT INTO workflow_deliveries VALUES (?, ?, ?, ?, ?)",
                (d.idempotency_key, d.operation_id, d.thread_id, d.interrupt_id, json.dumps(response)),
            )
            db.execute("COMMIT")
        self.enqueue_next(d.thread_id)
        return 200, response

    # -- plumbing ------------------------------------------------------------

    async def _pause_checkpoint(self, workflow: Workflow, pending: list[FunctionApprovalRequest]) -> str:
        checkpoint_id = await workflow.resolve_pause_checkpoint_id([p.request_id for p in pending])
        if checkpoint_id is None:
            raise RuntimeError(
                "the workflow paused without a pause checkpoint: is the request type listed in "
                "FileCheckpointStorage(allowed_checkpoint_types=...)?"
            )
        return checkpoint_id

    def _insert_pause(
        self,
        run_id: str,
        checkpoint_id: str | None,
        pending: list[FunctionApprovalRequest],
        outputs: Any,
        db: sqlite3.Connection | None = None,
    ) -> None:
        own = db is None
        conn = self._db() if own else db
        try:
            seq = conn.execute(
                "SELECT COALESCE(MAX(seq), 0) + 1 FROM workflow_pauses WHERE run_id = ?", (run_id,)
            ).fetchone()[0]
            conn.execute(
                "INSERT INTO workflow_pauses (run_id, seq, checkpoint_id, pending, outputs, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (
                    run_id,
                    seq,
                    checkpoint_id,
                    json.dumps([asdict(p) for p in pending]),
                    None if outputs is None else json.dumps(outputs),
                    time.time(),
                ),
            )
        finally:
            if own:
                conn.close()

    def _db(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.db_path, timeout=30, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        return db

    def _lock(self, run_id: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(run_id, threading.Lock())


def _err(code: str, detail: str) -> dict:
    return {"code": code, "detail": detail}

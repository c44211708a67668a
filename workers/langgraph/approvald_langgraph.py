"""Resume LangGraph interrupts with approvald's decisions.

The graph pauses with ``interrupt(approval_request(...))`` before a protected
write. ``LangGraphApprovals.request_approvals(thread_id, ...)`` enqueues one
approvald operation per pending interrupt of the thread's current checkpoint
(operation key ``<thread_id>:<interrupt_id>``). When approvald delivers the
outcome, ``handle(delivery)`` (a verified ``approvald_client.Delivery``):

1. answers a repeat of an already handled delivery with the stored answer;
2. reloads the thread's current checkpoint and checks that exactly that
   interrupt is still pending (LangGraph would silently ignore or
   re-interrupt on a stale or wrong id);
3. claims the interrupt for this operation in a ledger (one operation per
   interrupt, ever);
4. resumes with ``Command(resume={interrupt_id: delivery.resume_value()})``.

The resume value carries ``status``, ``approved``, ``permitId`` and
``idempotencyKey``: the node after the interrupt runs the protected write
only when ``grants_permission(value)``, keyed by ``idempotencyKey``, and
takes any other status as a rejection.

One worker process per checkpoint database: deliveries of one thread are
serialized in-process (approvald itself delivers one operation of a thread
at a time).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Callable
from contextlib import closing
from typing import Any

from approvald_client import ApprovaldClient, Delivery
from langgraph.types import Command

log = logging.getLogger("approvald_langgraph")

LEDGER = """
CREATE TABLE IF NOT EXISTS langgraph_resumes (
    thread_id       TEXT NOT NULL,
    interrupt_id    TEXT NOT NULL,
    operation_id    TEXT NOT NULL,
    idempotency_key TEXT NOT NULL UNIQUE,
    checkpoint_id   TEXT,
    state           TEXT NOT NULL CHECK (state IN ('resuming', 'done')),
    response        TEXT,
    PRIMARY KEY (thread_id, interrupt_id)
);
"""

# The enqueue fields an interrupt's value may carry (snake_case, as the client takes them).
REQUEST_FIELDS = (
    "question",
    "type",
    "options",
    "tool_name",
    "tool_target",
    "actor",
    "environment",
    "parameters",
    "context",
    "placeholder",
    "presentation",
    "agent_name",
    "revision",
)


def approval_request(question: str, **fields: Any) -> dict:
    """The value to pass to ``interrupt()``: what the person is asked, and the
    bound subject (``tool_name=``, ``tool_target=``, ``parameters=``…)."""
    unknown = set(fields) - set(REQUEST_FIELDS)
    if unknown:
        raise TypeError(f"not approval request fields: {sorted(unknown)}")
    return {"approvald": True, "question": question, **fields}


def grants_permission(value: Any) -> bool:
    """True only for the resume value of an approved confirm whose permit
    approvald consumed: the one case in which the protected write may run."""
    return (
        isinstance(value, dict)
        and value.get("status") == "approved"
        and value.get("approved") is True
        and bool(value.get("permitId"))
        and bool(value.get("idempotencyKey"))
    )


class LangGraphApprovals:
    def __init__(
        self,
        graph: Any,
        client: ApprovaldClient,
        *,
        effect: str,
        ledger_path: str,
        summarize: Callable[[dict], Any] | None = None,
    ):
        """``graph`` is compiled with a durable checkpointer (e.g.
        ``SqliteSaver``); ``effect`` names approvald's effect target that
        points at this worker; ``ledger_path`` is a SQLite file of the
        worker's own; ``summarize(values)`` makes the answer body (kept by
        approvald as the operation's result, ≤ 16 KiB)."""
        self.graph = graph
        self.client = client
        self.effect = effect
        self.ledger_path = ledger_path
        self.summarize = summarize or (lambda values: None)
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        with closing(self._db()) as db:
            db.executescript(LEDGER)

    # -- the application side ---------------------------------------------

    def request_approvals(
        self,
        thread_id: str,
        *,
        external_id: str,
        expires_in_seconds: int | None = None,
        effect: str | None = None,
        **extra: Any,
    ) -> list[dict]:
        """Enqueues one operation per pending interrupt of the thread's current
        checkpoint; safe to call again (enqueue is idempotent on the key).
        ``extra`` adds enqueue fields (``agent_name=``, ``actor=``…)."""
        snapshot = self.graph.get_state(_config(thread_id))
        checkpoint_id = snapshot.config["configurable"].get("checkpoint_id")
        ops = []
        for intr in snapshot.interrupts:
            value = intr.value if isinstance(intr.value, dict) else {}
            if not value.get("approvald"):
                continue  # an interrupt that is not an approval request
            fields = {k: value[k] for k in REQUEST_FIELDS if k in value}
            fields.update(extra)
            ops.append(
                self.client.enqueue(
                    operation_key=f"{thread_id}:{intr.id}",
                    thread_id=thread_id,
                    interrupt_id=intr.id,
                    checkpoint_id=checkpoint_id,
                    effect=effect or self.effect,
                    external_id=external_id,
                    expires_in_seconds=expires_in_seconds,
                    **fields,
                )
            )
        return ops

    # -- the effect target ---------------------------------------------------

    def handle(self, delivery: Delivery) -> tuple[int, Any]:
        with self._lock(delivery.thread_id):
            return self._handle(delivery)

    def _handle(self, d: Delivery) -> tuple[int, Any]:
        cfg = _config(d.thread_id)
        with closing(self._db()) as db:
            row = db.execute(
                "SELECT operation_id, idempotency_key, state, response FROM langgraph_resumes"
                " WHERE thread_id = ? AND interrupt_id = ?",
                (d.thread_id, d.interrupt_id),
            ).fetchone()
        if row is not None:
            op_id, key, state, response = row
            if op_id != d.operation_id or key != d.idempotency_key:
                return 409, _err("interrupt_already_answered", "another operation already resumed this interrupt")
            if state == "done":
                return 200, json.loads(response)  # a repeat: nothing changes

        snapshot = self.graph.get_state(cfg)
        pending = {i.id for i in snapshot.interrupts}
        if d.interrupt_id not in pending:
            if row is None:
                return 409, _err("interrupt_not_pending", "the thread has no such pending interrupt")
            # Claimed by this operation and answered already: an earlier
            # attempt resumed it, then failed or crashed. If the run stopped
            # short of its next pause or its end, continue it from the last
            # checkpoint (the failed node runs again; its write is keyed by
            # the idempotency key).
            if snapshot.next and not snapshot.interrupts:
                log.info("continuing thread %s after an interrupted resume", d.thread_id)
                self.graph.invoke(None, cfg)
            return 200, self._finish(d, self.graph.get_state(cfg))

        if row is None:
            with closing(self._db()) as db:
                try:
                    db.execute(
                        "INSERT INTO langgraph_resumes (thread_id, interrupt_id, operation_id, idempotency_key,"
                        " checkpoint_id, state) VALUES (?, ?, ?, ?, ?, 'resuming')",
                        (
                            d.thread_id,
                            d.interrupt_id,
                            d.operation_id,
                            d.idempotency_key,
                            snapshot.config["configurable"].get("checkpoint_id"),
                        ),
                    )
                except sqlite3.IntegrityError:
                    return 409, _err("interrupt_already_answered", "another operation already resumed this interrupt")

        log.info("resuming thread %s interrupt %s with %s", d.thread_id, d.interrupt_id, d.status)
        self.graph.invoke(Command(resume={d.interrupt_id: d.resume_value()}), cfg)
        return 200, self._finish(d, self.graph.get_state(cfg))

    def _finish(self, d: Delivery, snapshot: Any) -> dict:
        response = {
            "threadId": d.thread_id,
            "interruptId": d.interrupt_id,
            "status": d.status,
            "pendingInterrupts": [i.id for i in snapshot.interrupts],
            "result": self.summarize(snapshot.values),
        }
        with closing(self._db()) as db:
            db.execute(
                "UPDATE langgraph_resumes SET state = 'done', response = ? WHERE thread_id = ? AND interrupt_id = ?",
                (json.dumps(response), d.thread_id, d.interrupt_id),
            )
        return response

    # -- plumbing ------------------------------------------------------------

    def _db(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.ledger_path, timeout=30, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        return db

    def _lock(self, thread_id: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(thread_id, threading.Lock())


def _config(thread_id: str) -> dict:
    return {"configurable": {"thread_id": thread_id}}


def _err(code: str, detail: str) -> dict:
    return {"code": code, "detail": detail}

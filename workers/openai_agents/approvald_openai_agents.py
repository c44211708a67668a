"""Resume OpenAI Agents SDK runs with approvald's decisions.

A run stops with ``result.interruptions`` (``ToolApprovalItem``s of tools
declared ``needs_approval``). ``AgentsApprovals.save_pause(thread_id, result)``
stores the serialized ``RunState`` server-side (a snapshot, numbered per
thread) and enqueues an approvald operation for the *first* pending
interruption only: one question at a time, in order (operation key
``<thread_id>:<call_id>``, ``interruptId`` = the tool call's ``call_id``,
``checkpointId`` = ``<thread_id>:<snapshot number>``).

When approvald delivers the outcome, ``handle(delivery)`` (a verified
``approvald_client.Delivery``):

1. answers a repeat of an already handled delivery with the stored answer;
2. takes the thread's latest snapshot and checks that this call id is one of
   its pending interruptions;
3. consumes that snapshot for this operation with a compare-and-set
   (``consumed_by``): approving a stale snapshot again would run the tool
   again, so a snapshot is resumed by one operation only;
4. records the grant (permit and idempotency key) for the call, restores
   the ``RunState``, approves or rejects the interruption by ``call_id`` and
   continues the run with that state;
5. stores the resulting state as the next snapshot together with its answer,
   in one transaction, and enqueues the next pending interruption, if any.

Protected tools check ``permit_for(thread_id, call_id)`` themselves and write with its
idempotency key, so the write happens at most once even if a run is retried
after a crash.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from typing import Any

from agents import Agent, RunResult, Runner, RunState
from approvald_client import ApprovaldClient, Delivery

log = logging.getLogger("approvald_openai_agents")

SCHEMA = """
CREATE TABLE IF NOT EXISTS agent_snapshots (
    thread_id   TEXT NOT NULL,
    seq         INTEGER NOT NULL,
    state       TEXT NOT NULL,          -- RunState.to_string(); never leaves the server
    pending     TEXT NOT NULL,          -- JSON list of the pending calls, in order
    final       TEXT,                   -- JSON final output once the run completed
    consumed_by TEXT,                   -- the operation that resumed this snapshot
    created_at  REAL NOT NULL,
    PRIMARY KEY (thread_id, seq)
);
CREATE TABLE IF NOT EXISTS agent_grants (
    thread_id       TEXT NOT NULL,
    call_id         TEXT NOT NULL,
    operation_id    TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    permit_id       TEXT NOT NULL,
    PRIMARY KEY (thread_id, call_id)
);
CREATE TABLE IF NOT EXISTS agent_deliveries (
    idempotency_key TEXT PRIMARY KEY,
    operation_id    TEXT NOT NULL,
    thread_id       TEXT NOT NULL,
    call_id         TEXT NOT NULL,
    response        TEXT NOT NULL
);
"""


@dataclass(frozen=True)
class Grant:
    """Permission for one tool call: approvald consumed this permit for it."""

    call_id: str
    operation_id: str
    idempotency_key: str
    permit_id: str


@dataclass(frozen=True)
class PendingCall:
    """One interruption: a tool call waiting for approval."""

    call_id: str
    name: str
    arguments: str | None
    agent_name: str | None

    @classmethod
    def of(cls, item: Any) -> PendingCall:
        agent = getattr(item, "agent", None)
        return cls(item.call_id, item.name, item.arguments, getattr(agent, "name", None))


@dataclass(frozen=True)
class Snapshot:
    thread_id: str
    seq: int
    state: str
    pending: list[PendingCall]
    final: Any
    consumed_by: str | None

    @property
    def pending_ids(self) -> list[str]:
        return [p.call_id for p in self.pending]


def _flat_parameters(arguments: str | None) -> dict | None:
    """The tool arguments as approvald parameters, when they fit its bounds."""
    try:
        args = json.loads(arguments or "{}")
    except ValueError:
        return None
    if not isinstance(args, dict) or len(args) > 32:
        return None
    for k, v in args.items():
        if not (1 <= len(k) <= 64):
            return None
        if isinstance(v, str) and len(v) > 200:
            return None
        if not isinstance(v, (str, int, float, bool)):
            return None
    return args


class AgentsApprovals:
    def __init__(
        self,
        client: ApprovaldClient,
        *,
        effect: str,
        db_path: str,
        external_id: str,
        build_agent: Callable[[], Agent],
        question: Callable[[PendingCall], str] | None = None,
        expires_in_seconds: int | None = None,
        rejection_message: Callable[[Delivery], str] | None = None,
    ):
        """``build_agent()`` returns the agent with the same name and tools as
        the paused run's (a fresh object per resume); ``external_id`` is the
        Pushary recipient who answers; ``question(item)`` words the question
        for a pending call."""
        self.client = client
        self.effect = effect
        self.db_path = db_path
        self.external_id = external_id
        self.build_agent = build_agent
        self.question = question or (lambda item: f"Allow {item.name}({item.arguments})?")
        self.expires_in_seconds = expires_in_seconds
        self.rejection_message = rejection_message or (
            lambda d: f"The tool call was not approved by a human (status: {d.status})."
        )
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        with closing(self._db()) as db:
            db.executescript(SCHEMA)

    # -- the application side ---------------------------------------------

    def save_pause(
        self, thread_id: str, result: RunResult, *, effect: str | None = None, expires_in_seconds: int | None = None
    ) -> dict | None:
        """Stores a run that stopped with interruptions (as the thread's first
        snapshot) and asks approvald about the first one. Returns that
        operation, or ``None`` when the run did not stop for an approval."""
        if not result.interruptions:
            return None
        pending = [PendingCall.of(item).__dict__ for item in result.interruptions]
        with closing(self._db()) as db:
            db.execute("BEGIN IMMEDIATE")
            seq = db.execute(
                "SELECT COALESCE(MAX(seq), 0) + 1 FROM agent_snapshots WHERE thread_id = ?", (thread_id,)
            ).fetchone()[0]
            db.execute(
                "INSERT INTO agent_snapshots (thread_id, seq, state, pending, created_at) VALUES (?, ?, ?, ?, ?)",
                (thread_id, seq, result.to_state().to_string(), json.dumps(pending), time.time()),
            )
            db.execute("COMMIT")
        return self.enqueue_next(thread_id, effect=effect, expires_in_seconds=expires_in_seconds)

    def enqueue_next(
        self, thread_id: str, *, effect: str | None = None, expires_in_seconds: int | None = None
    ) -> dict | None:
        """Enqueues the first pending interruption of the thread's latest
        snapshot (idempotent: the same key and content give the same operation)."""
        snap = self.latest(thread_id)
        if snap is None or not snap.pending or snap.consumed_by is not None:
            return None
        item = snap.pending[0]
        return self.client.enqueue(
            operation_key=f"{thread_id}:{item.call_id}",
            thread_id=thread_id,
            interrupt_id=item.call_id,
            checkpoint_id=f"{thread_id}:{snap.seq}",
            effect=effect or self.effect,
            external_id=self.external_id,
            question=self.question(item)[:500],
            tool_name=item.name,
            parameters=_flat_parameters(item.arguments),
            agent_name=item.agent_name,
            expires_in_seconds=expires_in_seconds or self.expires_in_seconds,
        )

    def latest(self, thread_id: str) -> Snapshot | None:
        with closing(self._db()) as db:
            row = db.execute(
                "SELECT thread_id, seq, state, pending, final, consumed_by FROM agent_snapshots"
                " WHERE thread_id = ? ORDER BY seq DESC LIMIT 1",
                (thread_id,),
            ).fetchone()
        return None if row is None else _snapshot(row)

    def snapshots(self, thread_id: str) -> list[Snapshot]:
        """Every snapshot of the thread, oldest first (for inspection)."""
        with closing(self._db()) as db:
            rows = db.execute(
                "SELECT thread_id, seq, state, pending, final, consumed_by FROM agent_snapshots"
                " WHERE thread_id = ? ORDER BY seq",
                (thread_id,),
            ).fetchall()
        return [_snapshot(r) for r in rows]

    def permit_for(self, thread_id: str, call_id: str) -> Grant | None:
        """For protected tools: the grant of this call, if a human approved it."""
        with closing(self._db()) as db:
            row = db.execute(
                "SELECT call_id, operation_id, idempotency_key, permit_id FROM agent_grants"
                " WHERE thread_id = ? AND call_id = ?",
                (thread_id, call_id),
            ).fetchone()
        return Grant(*row) if row else None

    # -- the effect target ---------------------------------------------------

    def handle(self, delivery: Delivery) -> tuple[int, Any]:
        """Synchronous entry point (for ``approvald_client.receiver``)."""
        with self._lock(delivery.thread_id):
            return asyncio.run(self._handle(delivery))

    async def _handle(self, d: Delivery) -> tuple[int, Any]:
        with closing(self._db()) as db:
            row = db.execute(
                "SELECT response FROM agent_deliveries WHERE idempotency_key = ?", (d.idempotency_key,)
            ).fetchone()
        if row is not None:
            self.enqueue_next(d.thread_id)  # in case a crash came between the two
            return 200, json.loads(row[0])

        snap = self.latest(d.thread_id)
        if snap is None or d.interrupt_id not in snap.pending_ids:
            return 409, _err("interrupt_not_pending", "the thread's latest snapshot has no such pending call")
        with closing(self._db()) as db:
            db.execute("BEGIN IMMEDIATE")
            claimed = db.execute(
                "UPDATE agent_snapshots SET consumed_by = ? WHERE thread_id = ? AND seq = ?"
                " AND (consumed_by IS NULL OR consumed_by = ?)",
                (d.operation_id, d.thread_id, snap.seq, d.operation_id),
            ).rowcount
            if claimed != 1:
                db.execute("ROLLBACK")
                return 409, _err("snapshot_consumed", "another operation already resumed this snapshot")
            if d.grants_permission:
                db.execute(
                    "INSERT OR IGNORE INTO agent_grants VALUES (?, ?, ?, ?, ?)",
                    (d.thread_id, d.interrupt_id, d.operation_id, d.idempotency_key, d.permit_id),
                )
            db.execute("COMMIT")

        agent = self.build_agent()
        state = await RunState.from_string(agent, snap.state)
        item = next((i for i in state.get_interruptions() if i.call_id == d.interrupt_id), None)
        if item is None:
            raise RuntimeError(f"snapshot {d.thread_id}:{snap.seq} lost call {d.interrupt_id}")
        if d.grants_permission:
            state.approve(item)
        else:
            state.reject(item, rejection_message=self.rejection_message(d))
        log.info("resuming thread %s call %s with %s", d.thread_id, d.interrupt_id, d.status)
        result = await Runner.run(agent, state)

        pending = [PendingCall.of(i) for i in result.interruptions]
        final = None if pending else result.final_output
        response = {
            "threadId": d.thread_id,
            "callId": d.interrupt_id,
            "status": d.status,
            "pendingCallIds": [p.call_id for p in pending],
            "finalOutput": final if isinstance(final, (str, int, float, bool, type(None))) else str(final),
        }
        with closing(self._db()) as db:
            db.execute("BEGIN IMMEDIATE")
            db.execute(
                "INSERT INTO agent_snapshots (thread_id, seq, state, pending, final, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (
                    d.thread_id,
                    snap.seq + 1,
                    result.to_state().to_string(),
                    json.dumps([p.__dict__ for p in pending]),
                    json.dumps(response["finalOutput"]),
                    time.time(),
                ),
            )
            db.execute(
                "INSERT INTO agent_deliveries VALUES (?, ?, ?, ?, ?)",
                (d.idempotency_key, d.operation_id, d.thread_id, d.interrupt_id, json.dumps(response)),
            )
            db.execute("COMMIT")
        self.enqueue_next(d.thread_id)
        return 200, response

    # -- plumbing ------------------------------------------------------------

    def _db(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.db_path, timeout=30, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        return db

    def _lock(self, thread_id: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(thread_id, threading.Lock())


def _snapshot(row: tuple) -> Snapshot:
    pending = [PendingCall(**p) for p in json.loads(row[3])]
    return Snapshot(row[0], row[1], row[2], pending, json.loads(row[4]) if row[4] else None, row[5])


def _err(code: str, detail: str) -> dict:
    return {"code": code, "detail": detail}

"""An order service that places an order only with a human's approval,
through approvald, without any agent framework.

* ``request_order(...)`` asks approvald for the approval (one operation per
  order; enqueue is idempotent on the order's key).
* ``OrderService.handle(delivery)`` is the effect target: it runs at most once
  per ``Idempotency-Key``, in one SQLite transaction that records the order
  (only for an ``approved`` delivery carrying a permit) together with the
  answer it gives, and answers every repeat with that stored answer.

Run the endpoint:  python orders_service.py serve --db orders.db --port 8091
(the effect secret from APPROVALD_EFFECT_SECRET).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sqlite3
import time
from contextlib import closing
from typing import Any

from approvald_client import ApprovaldClient, Delivery
from approvald_client.receiver import DeliveryServer, signed

SCHEMA = """
CREATE TABLE IF NOT EXISTS orders (
    idempotency_key TEXT PRIMARY KEY,
    operation_id    TEXT NOT NULL,
    order_ref       TEXT NOT NULL,
    amount          REAL NOT NULL,
    currency        TEXT NOT NULL,
    permit_id       TEXT NOT NULL,
    created_at      REAL NOT NULL
);
-- One row per delivery key: the answer given, replayed to every repeat.
CREATE TABLE IF NOT EXISTS outcomes (
    idempotency_key TEXT PRIMARY KEY,
    operation_id    TEXT NOT NULL,
    status          TEXT NOT NULL,
    response        TEXT NOT NULL
);
"""


def request_order(
    client: ApprovaldClient,
    *,
    order_ref: str,
    amount: float,
    currency: str,
    approver: str,
    effect: str = "orders",
    expires_in_seconds: int | None = None,
) -> dict:
    """Asks ``approver`` (a Pushary externalId) to approve placing an order.
    There is no framework interrupt here: the order itself is the thread and
    the pending step."""
    return client.enqueue(
        operation_key=f"order-{order_ref}",
        thread_id=f"order-{order_ref}",
        interrupt_id=f"place-{order_ref}",
        effect=effect,
        external_id=approver,
        question=f"Place order {order_ref} for {amount:g} {currency}?",
        tool_name="place_order",
        tool_target=order_ref,
        parameters={"amount": amount, "currency": currency},
        expires_in_seconds=expires_in_seconds,
    )


class OrderService:
    def __init__(self, db_path: str):
        self.db_path = db_path
        with closing(self._connect()) as db:
            db.executescript(SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.db_path, timeout=30, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        return db

    def handle(self, delivery: Delivery) -> tuple[int, Any]:
        """The effect, at most once per idempotency key (a verified delivery)."""
        with closing(self._connect()) as db:
            db.execute("BEGIN IMMEDIATE")  # one delivery of any key at a time
            try:
                row = db.execute(
                    "SELECT response FROM outcomes WHERE idempotency_key = ?", (delivery.idempotency_key,)
                ).fetchone()
                if row is not None:
                    db.execute("ROLLBACK")
                    return 200, json.loads(row[0])  # a repeat: the stored answer
                if delivery.grants_permission:
                    response = self._place(db, delivery)
                else:
                    response = {"placed": False, "status": delivery.status}
                db.execute(
                    "INSERT INTO outcomes (idempotency_key, operation_id, status, response) VALUES (?, ?, ?, ?)",
                    (delivery.idempotency_key, delivery.operation_id, delivery.status, json.dumps(response)),
                )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return 200, response

    def _place(self, db: sqlite3.Connection, d: Delivery) -> dict:
        params = d.subject.parameters
        order_ref, amount, currency = d.subject.tool_target, params.get("amount"), params.get("currency")
        if d.subject.tool_name != "place_order" or not order_ref or not isinstance(amount, (int, float)):
            # Signed by approvald but not an order this service asked about.
            return {"placed": False, "status": "not_an_order"}
        db.execute(
            "INSERT INTO orders (idempotency_key, operation_id, order_ref, amount, currency, permit_id, created_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (d.idempotency_key, d.operation_id, order_ref, float(amount), str(currency), d.permit_id, time.time()),
        )
        return {"placed": True, "orderRef": order_ref, "permitId": d.permit_id}

    def orders(self, order_ref: str | None = None) -> list[dict]:
        with closing(self._connect()) as db:
            db.row_factory = sqlite3.Row
            sql, args = "SELECT * FROM orders", ()
            if order_ref is not None:
                sql, args = sql + " WHERE order_ref = ?", (order_ref,)
            return [dict(r) for r in db.execute(sql, args)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve the effect target")
    s.add_argument("--db", required=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8091)
    s.add_argument("--path", default="/approvals")
    r = sub.add_parser("request", help="ask approvald to approve an order (APPROVALD_URL, APPROVALD_TOKEN)")
    r.add_argument("order_ref")
    r.add_argument("amount", type=float)
    r.add_argument("currency")
    r.add_argument("--approver", required=True)
    r.add_argument("--effect", default="orders")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.cmd == "serve":
        secret = os.environ["APPROVALD_EFFECT_SECRET"]
        server = DeliveryServer(signed(secret, OrderService(args.db).handle), args.host, args.port, args.path)
        logging.info("orders service on %s", server.url)
        server.serve_forever()
    else:
        client = ApprovaldClient(
            os.environ.get("APPROVALD_URL", "http://127.0.0.1:8080"), os.environ["APPROVALD_TOKEN"]
        )
        op = request_order(
            client,
            order_ref=args.order_ref,
            amount=args.amount,
            currency=args.currency,
            approver=args.approver,
            effect=args.effect,
        )
        print(json.dumps({"id": op["id"], "state": op["state"]}))


if __name__ == "__main__":
    main()

"""The Agent Framework refund worker: the effect target approvald delivers to.

    python worker.py serve --data ./data --port 8094 --approver user-1
    python worker.py start --data ./data --approver user-1 RUN_ID ORDER_ID AMOUNT [--currency EUR]

(APPROVALD_URL, APPROVALD_TOKEN and APPROVALD_EFFECT_SECRET from the environment.)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from approvald_client import ApprovaldClient
from approvald_client.receiver import DeliveryServer

from refund_workflow import RefundWorkflowApp


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve the effect target")
    s.add_argument("--port", type=int, default=8094)
    s.add_argument("--host", default="127.0.0.1")
    r = sub.add_parser("start", help="start a refund run and ask for its approval")
    r.add_argument("run_id")
    r.add_argument("order_id")
    r.add_argument("amount", type=float)
    r.add_argument("--currency", default="EUR")
    for sp in (s, r):
        sp.add_argument("--data", required=True)
        sp.add_argument("--approver", required=True)
        sp.add_argument("--effect", default="orders")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    client = ApprovaldClient(os.environ.get("APPROVALD_URL", "http://127.0.0.1:8080"), os.environ["APPROVALD_TOKEN"])
    app = RefundWorkflowApp(
        args.data, client, approver=args.approver, effect=args.effect, secret=os.environ.get("APPROVALD_EFFECT_SECRET")
    )
    if args.cmd == "serve":
        server = DeliveryServer(app.approvals.handle_request, args.host, args.port)
        logging.info("Agent Framework refund worker on %s", server.url)
        server.serve_forever()
    else:
        op = asyncio.run(app.start(args.run_id, args.order_id, args.amount, args.currency))
        print(op["id"] if op else "the run finished without asking for approval")


if __name__ == "__main__":
    main()

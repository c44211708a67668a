"""Drives the published SDK with a list of calls, for the golden comparison in
tests/it/sdk.rs: the same calls are made with approvald's Rust client (or by
approvald itself) against a capture server, and the requests must be equal.

Reads one JSON object on stdin:
  {"base_url": "...", "api_key": "...", "calls": [{"op": ..., ...}, ...]}
and prints one JSON array on stdout: per call, {"ok": <returned dict>} or
{"error": "<what was raised>", "status": <http status or null>}.

The op "construct" only builds a client ({"key": ...}) and reports whether the
constructor raised; it makes no request.
"""

import json
import sys

from pushary import PusharyError, PusharyServer


def run(client, call):
    op = call["op"]
    if op == "create":
        return client.decisions.create(call["question"], **call.get("kwargs", {}))
    if op == "get":
        return client.decisions.get(call["id"], wait=call.get("wait"))
    if op == "answer":
        return client.decisions.answer(call["id"], call["answer"])
    if op == "cancel":
        return client.decisions.cancel(call["id"])
    if op == "consume":
        return client.consume_authorization(call["authorization_id"], call["tool_name"], **call.get("kwargs", {}))
    if op == "receipt":
        return client.record_execution(call["permit_id"], call["outcome"], summary=call.get("summary"))
    if op == "webhook_secret":
        return client.decisions.get_webhook_secret()
    if op == "rotate_webhook_secret":
        return client.decisions.rotate_webhook_secret()
    raise SystemExit(f"golden.py: unknown op {op!r}")


def main():
    spec = json.load(sys.stdin)
    results = []
    client = None
    for call in spec["calls"]:
        if call["op"] == "construct":
            try:
                PusharyServer(call["key"], base_url=spec.get("base_url"))
                results.append({"raises": False})
            except ValueError as error:
                results.append({"raises": True, "error": str(error)})
            continue
        if client is None:
            client = PusharyServer(spec["api_key"], base_url=spec["base_url"])
        try:
            results.append({"ok": run(client, call)})
        except PusharyError as error:
            results.append({"error": error.message, "status": error.status, "body": error.body})
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()

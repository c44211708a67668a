"""ApprovaldClient against a stub HTTP server: wire names, methods, errors."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from approvald_client import ApprovaldClient, ApprovaldError
from approvald_client.client import camel_case
from approvald_client.testing import free_port


class Stub:
    """Answers each request with the next scripted (status, body) and records it."""

    def __init__(self):
        self.requests = []
        self.replies = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _any(self):
                n = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(n) if n else b""
                outer.requests.append((self.command, self.path, dict(self.headers.items()), body))
                status, reply = outer.replies.pop(0)
                raw = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            do_GET = do_POST = do_DELETE = _any

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stub():
    s = Stub()
    yield s
    s.close()


def test_camel_case():
    assert camel_case("operation_key") == "operationKey"
    assert camel_case("expires_in_seconds") == "expiresInSeconds"
    assert camel_case("type") == "type"


def test_enqueue_sends_only_given_fields_in_camel_case(stub):
    stub.replies.append((201, {"id": "op_1", "state": "enqueued"}))
    client = ApprovaldClient(stub.url + "/", "token-0123456789abcdef")
    op = client.enqueue(
        operation_key="k",
        thread_id="t",
        interrupt_id="i",
        effect="orders",
        external_id="u",
        question="Refund?",
        tool_name="refund",
        parameters={"amount": 40},
        expires_in_seconds=60,
        checkpoint_id=None,
    )
    assert op == {"id": "op_1", "state": "enqueued"}
    method, path, headers, body = stub.requests[0]
    assert (method, path) == ("POST", "/v1/operations")
    assert headers["Authorization"] == "Bearer token-0123456789abcdef"
    assert headers["Content-Type"] == "application/json"
    assert json.loads(body) == {
        "operationKey": "k",
        "threadId": "t",
        "interruptId": "i",
        "effect": "orders",
        "externalId": "u",
        "question": "Refund?",
        "toolName": "refund",
        "parameters": {"amount": 40},
        "expiresInSeconds": 60,
    }


def test_unknown_field_is_refused_before_sending(stub):
    client = ApprovaldClient(stub.url, "t" * 20)
    with pytest.raises(TypeError, match="tool_nme"):
        client.enqueue(operation_key="k", tool_nme="x")
    assert stub.requests == []


def test_get_list_and_cancel(stub):
    client = ApprovaldClient(stub.url, "t" * 20)
    stub.replies += [
        (200, {"id": "op/1"}),
        (200, {"id": "op_2", "state": "cancelled"}),
        (200, {"operations": [{"id": "a"}]}),
    ]
    assert client.get("op/1") == {"id": "op/1"}
    assert client.cancel("op_2")["state"] == "cancelled"
    assert client.list(state="pending", thread_id="t 1", limit=5) == [{"id": "a"}]
    assert [(m, p) for m, p, _, _ in stub.requests] == [
        ("GET", "/v1/operations/op%2F1"),
        ("DELETE", "/v1/operations/op_2"),
        ("GET", "/v1/operations?state=pending&threadId=t+1&limit=5"),
    ]


def test_approvald_errors_carry_status_code_detail_and_field(stub):
    client = ApprovaldClient(stub.url, "t" * 20)
    stub.replies.append((422, {"code": "out_of_bounds", "detail": "must be 1-500 characters", "field": "question"}))
    with pytest.raises(ApprovaldError) as e:
        client.enqueue(operation_key="k", question="")
    assert (e.value.status, e.value.code, e.value.field) == (422, "out_of_bounds", "question")
    assert e.value.detail == "must be 1-500 characters"
    assert "question" in str(e.value)

    stub.replies.append((409, {"code": "operation_key_conflict", "detail": "different content"}))
    with pytest.raises(ApprovaldError) as e:
        client.enqueue(operation_key="k")
    assert (e.value.status, e.value.code, e.value.field) == (409, "operation_key_conflict", None)

    stub.replies.append((502, b"<html>bad gateway</html>"))
    with pytest.raises(ApprovaldError) as e:
        client.get("op_1")
    assert (e.value.status, e.value.code) == (502, "http_error") and "bad gateway" in e.value.detail


def test_unreachable_approvald():
    client = ApprovaldClient(f"http://127.0.0.1:{free_port()}", "t" * 20, timeout=2)
    with pytest.raises(ApprovaldError) as e:
        client.get("op_1")
    assert e.value.status is None and e.value.code == "unreachable"


def test_token_is_not_in_repr():
    assert "secret-token" not in repr(ApprovaldClient("http://127.0.0.1:1", "secret-token-0123456789"))

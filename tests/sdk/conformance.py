"""The published Python SDK `pushary`, unchanged, as the referee of the
approvald Pushary sandbox: every call the SDK offers must behave against the
sandbox as the SDK's docstrings say.

Run by tests/it/sdk.rs in a venv per SDK version, with:
  PUSHARY_BASE_URL     the sandbox's .../api/v1/server
  PUSHARY_API_KEY      the sandbox's key
  SANDBOX_CONTROL_URL  the sandbox's .../sandbox/api
  EXPECT_SDK_VERSION   the version the venv must hold
Exit status 0 only when every test passed.
"""

import os
import sys
import time
import unittest
import uuid
from urllib.parse import quote

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pushary  # noqa: E402
from pushary import (  # noqa: E402
    SIGNATURE_HEADER,
    PusharyError,
    PusharyServer,
    parse_decision_callback,
    verify_webhook_signature,
)
from pushary.adapters import (  # noqa: E402
    REFUSED_REPLAY,
    AdapterKernel,
    refused_permit,
    resolve_pushary_callback,
)

from support import (  # noqa: E402
    Background,
    CallbackReceiver,
    control,
    env,
    http_get,
    pending_decision_with_key,
    sandbox_answer,
    sandbox_decisions,
    wait_until,
)

BASE_URL = env("PUSHARY_BASE_URL")
API_KEY = env("PUSHARY_API_KEY")

CREATE_KEYS = {"decisionId", "status", "type", "question", "decisionPageUrl", "pollUrl", "expiresInSeconds",
               "answered", "value"}
REACHABILITY_KEYS = {"reachable", "reachableChannels", "deviceCount"}
DECISION_KEYS = {"decisionId", "status", "answered", "value", "type", "question", "options", "externalId",
                 "createdAt", "answeredAt", "expiresAt"}


def unique(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


class SdkConformance(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.p = PusharyServer(API_KEY, base_url=BASE_URL)
        cls.receiver = CallbackReceiver()

    @classmethod
    def tearDownClass(cls):
        cls.receiver.close()

    # -- helpers --------------------------------------------------------

    def raises(self, status, fn, *args, **kwargs):
        """Runs an SDK call that must raise PusharyError with `status`."""
        with self.assertRaises(PusharyError) as caught:
            fn(*args, **kwargs)
        error = caught.exception
        self.assertEqual(error.status, status, f"{error!r} body={error.body}")
        self.assertIsInstance(error.message, str)
        self.assertTrue(error.message)
        # The SDK's message is the body's `error` when it is a string.
        if isinstance(error.body.get("error"), str):
            self.assertEqual(error.message, error.body["error"])
        return error

    def approved_confirm(self, **subject):
        """A confirm with `subject`, answered yes on the phone."""
        created = self.p.decisions.create("Refund 40 EUR on order 1234?", **subject)
        sandbox_answer(created["decisionId"], "yes")
        return created["decisionId"]

    def callback_path(self):
        return "/" + unique("hook")

    # -- construction and authentication --------------------------------

    def test_installed_version_is_the_one_under_test(self):
        self.assertEqual(pushary.__version__, env("EXPECT_SDK_VERSION"))

    def test_constructor_refuses_keys_without_a_secret_half(self):
        for key in ["", "pk_only", None]:
            with self.assertRaises(ValueError):
                PusharyServer(key, base_url=BASE_URL)

    def test_a_wrong_key_is_a_401_pushary_error(self):
        wrong = PusharyServer("pk_wrong.secret", base_url=BASE_URL)
        error = self.raises(401, wrong.decisions.get_webhook_secret)
        self.assertIn("key", error.message.lower())
        self.raises(401, wrong.decisions.create, "Refund?")
        self.assertEqual(self.raises(401, wrong.decisions.get, "dec_x").status, 401)

    def test_base_url_with_a_trailing_slash_is_the_same_api(self):
        slashed = PusharyServer(API_KEY, base_url=BASE_URL + "/")
        self.assertEqual(slashed.decisions.get_webhook_secret(), self.p.decisions.get_webhook_secret())

    # -- create ---------------------------------------------------------

    def test_create_confirm_for_a_recipient(self):
        external_id = unique("user")
        created = self.p.decisions.create(
            "Approve the $4,200 payout to Acme Corp?",
            external_id=external_id,
            agent_name="Billing",
            context="Invoice INV-8842",
            expires_in_seconds=900,
            tool_name="payout",
            parameters={"amount": 4200, "vendor": "Acme"},
        )
        self.assertTrue(CREATE_KEYS | REACHABILITY_KEYS <= set(created), created)
        decision_id = created["decisionId"]
        self.assertIsInstance(decision_id, str)
        self.assertEqual(created["status"], "pending")
        self.assertEqual(created["type"], "confirm")
        self.assertEqual(created["question"], "Approve the $4,200 payout to Acme Corp?")
        self.assertIs(created["answered"], False)
        self.assertIsNone(created["value"])
        self.assertEqual(created["expiresInSeconds"], 900)
        self.assertTrue(created["pollUrl"].endswith("/decisions/" + quote(decision_id, safe="")), created)
        self.assertIsInstance(created["decisionPageUrl"], str)
        self.assertIs(created["reachable"], True)
        self.assertTrue(created["reachableChannels"])
        self.assertGreaterEqual(created["deviceCount"], 1)
        self.assertNotIn("hint", created)  # only when a wait ran out

        got = self.p.decisions.get(decision_id)
        self.assertTrue(DECISION_KEYS <= set(got), got)
        self.assertEqual(got["decisionId"], decision_id)
        self.assertEqual((got["status"], got["answered"], got["value"]), ("pending", False, None))
        self.assertEqual(got["type"], "confirm")
        self.assertEqual(got["externalId"], external_id)
        self.assertIsNone(got["options"])
        self.assertIsInstance(got["createdAt"], str)
        self.assertIsInstance(got["expiresAt"], str)
        self.assertIsNone(got["answeredAt"])

    def test_create_without_recipient_has_no_reachability(self):
        created = self.p.decisions.create("Deploy to production?")
        self.assertEqual(created["status"], "pending")
        self.assertFalse(REACHABILITY_KEYS & set(created), created)
        self.assertIsNone(self.p.decisions.get(created["decisionId"])["externalId"])

    def test_create_select_and_answer_it(self):
        options = ["Standard", "Express", "Überweisung"]
        created = self.p.decisions.create("Which shipping?", type="select", options=options,
                                          external_id=unique("user"))
        decision_id = created["decisionId"]
        self.assertEqual(created["type"], "select")
        self.assertEqual(self.p.decisions.get(decision_id)["options"], options)
        self.raises(422, self.p.decisions.answer, decision_id, "express")  # exact text only
        answered = self.p.decisions.answer(decision_id, "Überweisung")
        self.assertEqual((answered["status"], answered["value"]), ("answered", "Überweisung"))
        got = self.p.decisions.get(decision_id)
        self.assertEqual((got["status"], got["answered"], got["value"]), ("answered", True, "Überweisung"))
        self.assertIsInstance(got["answeredAt"], str)

    def test_select_needs_options(self):
        self.raises(422, self.p.decisions.create, "Which?", type="select")
        self.raises(422, self.p.decisions.create, "Which?", type="select", options=["only"])
        self.raises(422, self.p.decisions.create, "Which?", type="poll")

    def test_create_input_and_answer_it(self):
        created = self.p.decisions.create("Why the refund?", type="input", placeholder="Reason",
                                          external_id=unique("user"))
        self.assertEqual(created["type"], "input")
        text = "Damaged in transit — colis abîmé 📦"
        self.assertEqual(self.p.decisions.answer(created["decisionId"], text)["value"], text)
        got = self.p.decisions.get(created["decisionId"])
        self.assertEqual((got["status"], got["type"], got["value"]), ("answered", "input", text))

    def test_idempotency_key_replays_the_same_decision(self):
        key = unique("idem")
        kwargs = dict(external_id=unique("user"), idempotency_key=key, tool_name="refund",
                      parameters={"amount": 40})
        first = self.p.decisions.create("Refund 40 EUR?", **kwargs)
        again = self.p.decisions.create("Refund 40 EUR?", **kwargs)
        self.assertEqual(again["decisionId"], first["decisionId"])
        self.assertEqual(again, first)
        # `wait` only changes how long the call blocks, not what is asked.
        self.assertEqual(self.p.decisions.create("Refund 40 EUR?", wait=False, **kwargs)["decisionId"],
                         first["decisionId"])
        self.assertEqual(len([d for d in sandbox_decisions() if d["idempotencyKey"] == key]), 1)
        # The same key with a different payload is refused, and creates nothing.
        self.raises(409, self.p.decisions.create, "Refund 45 EUR?", **kwargs)
        self.assertEqual(len([d for d in sandbox_decisions() if d["idempotencyKey"] == key]), 1)

    def test_without_idempotency_key_every_create_is_new(self):
        a = self.p.decisions.create("Same text?")
        b = self.p.decisions.create("Same text?")
        self.assertNotEqual(a["decisionId"], b["decisionId"])

    def test_require_reachable_refuses_an_unreachable_recipient_with_409(self):
        external_id = unique("unreachable")
        error = self.raises(409, self.p.decisions.create, "Refund?", external_id=external_id,
                            require_reachable=True)
        self.assertIs(error.body.get("reachable"), False)
        self.assertFalse([d for d in sandbox_decisions() if d["externalId"] == external_id],
                         "a refused create must not open a decision")
        # Without require_reachable the decision opens, and says nobody can be reached.
        created = self.p.decisions.create("Refund?", external_id=external_id)
        self.assertEqual((created["reachable"], created["reachableChannels"], created["deviceCount"]),
                         (False, [], 0))
        # A reachable recipient is not refused.
        ok = self.p.decisions.create("Refund?", external_id=unique("user"), require_reachable=True)
        self.assertIs(ok["reachable"], True)

    def test_enroll_makes_a_recipient_reachable_once(self):
        external_id = unique("unreachable")
        enrolled = self.p.enroll(external_id)
        link = enrolled["universalLink"]
        self.assertIsInstance(link, str)
        # The adapters read the link the same way.
        kernel_link = AdapterKernel("the conformance suite").connect(external_id, api_key=API_KEY,
                                                                     base_url=BASE_URL)
        self.assertNotEqual(kernel_link, link, "each link is single-use, so each enroll gives a new one")
        self.raises(409, self.p.decisions.create, "Refund?", external_id=external_id, require_reachable=True)
        self.assertEqual(http_get(link), 200)
        self.assertEqual(http_get(link), 410, "an enrollment link is single-use")
        created = self.p.decisions.create("Refund?", external_id=external_id, require_reachable=True)
        self.assertIs(created["reachable"], True)

    def test_create_with_wait_returns_a_hint_when_nobody_answers(self):
        started = time.monotonic()
        created = self.p.decisions.create("Anyone?", wait=True, timeout_seconds=1)
        self.assertGreaterEqual(time.monotonic() - started, 0.9, "the server must hold a waiting create")
        self.assertEqual(created["status"], "pending")
        self.assertIsInstance(created.get("hint"), str)

    def test_create_with_wait_resolves_when_answered(self):
        key = unique("wait")
        waiting = Background(lambda: self.p.decisions.create("Quick one?", wait=True, timeout_seconds=30,
                                                             idempotency_key=key))
        decision = pending_decision_with_key(key)
        # `answer` docstring: any waiting get or create call resolves immediately.
        self.p.decisions.answer(decision["decisionId"], "no")
        started = time.monotonic()
        created = waiting.result()
        self.assertLess(time.monotonic() - started, 10)
        self.assertEqual((created["decisionId"], created["status"], created["answered"], created["value"]),
                         (decision["decisionId"], "answered", True, "no"))

    # -- get --------------------------------------------------------------

    def test_get_with_wait_returns_once_answered(self):
        decision_id = self.p.decisions.create("Long poll?")["decisionId"]
        started = time.monotonic()
        polling = Background(lambda: self.p.decisions.get(decision_id, wait=30))
        sandbox_answer(decision_id, "yes")
        got = polling.result()
        self.assertLess(time.monotonic() - started, 10, "the long-poll must return on the answer")
        self.assertEqual((got["status"], got["answered"], got["value"]), ("answered", True, "yes"))

    def test_get_with_wait_holds_a_pending_decision(self):
        decision_id = self.p.decisions.create("Nobody answers this one?")["decisionId"]
        started = time.monotonic()
        got = self.p.decisions.get(decision_id, wait=1)
        self.assertGreaterEqual(time.monotonic() - started, 0.9, "the server must hold ?wait=1")
        self.assertEqual(got["status"], "pending")

    def test_get_unknown_ids_is_404_even_with_slashes(self):
        for weird in ["dec_nope", "does/not exist", "../webhook-secret", "dec_ü?x#y"]:
            self.raises(404, self.p.decisions.get, weird)
            self.raises(404, self.p.decisions.cancel, weird)
            self.raises(404, self.p.decisions.answer, weird, "yes")

    # -- answer and cancel -------------------------------------------------

    def test_answer_records_once_and_checks_the_type(self):
        decision_id = self.p.decisions.create("Approve?")["decisionId"]
        self.raises(422, self.p.decisions.answer, decision_id, "YES")
        self.assertEqual(self.p.decisions.get(decision_id)["status"], "pending")
        answered = self.p.decisions.answer(decision_id, "yes")
        self.assertEqual((answered["decisionId"], answered["status"], answered["value"]),
                         (decision_id, "answered", "yes"))
        self.raises(409, self.p.decisions.answer, decision_id, "no")
        self.assertEqual(self.p.decisions.get(decision_id)["value"], "yes")

    def test_cancel_closes_an_open_decision(self):
        decision_id = self.p.decisions.create("Cancel me?")["decisionId"]
        self.assertEqual(self.p.decisions.cancel(decision_id),
                         {"decisionId": decision_id, "cancelled": True, "status": "cancelled"})
        self.assertEqual(self.p.decisions.get(decision_id)["status"], "cancelled")
        self.raises(409, self.p.decisions.answer, decision_id, "yes")
        self.assertEqual(self.p.decisions.cancel(decision_id)["status"], "cancelled")
        # An answered decision is not open any more: nothing to cancel.
        answered = self.approved_confirm()
        self.assertEqual(self.p.decisions.cancel(answered),
                         {"decisionId": answered, "cancelled": False, "status": "answered"})

    # -- ask ----------------------------------------------------------------

    def test_ask_blocks_until_the_phone_answers(self):
        key = unique("ask")
        asking = Background(lambda: self.p.decisions.ask("Approve the refund?", external_id=unique("user"),
                                                         idempotency_key=key, timeout_seconds=30))
        decision = pending_decision_with_key(key)
        sandbox_answer(decision["decisionId"], "yes")
        result = asking.result()
        self.assertEqual(result["decisionId"], decision["decisionId"])
        self.assertEqual((result["status"], result["answered"], result["value"], result["type"]),
                         ("answered", True, "yes", "confirm"))
        self.assertIs(result["approved"], True)
        self.assertEqual((result["reachable"], result["deviceCount"]), (True, 1))

    def test_ask_is_fail_closed(self):
        key = unique("ask-no")
        asking = Background(lambda: self.p.decisions.ask("Approve?", idempotency_key=key, timeout_seconds=30))
        sandbox_answer(pending_decision_with_key(key)["decisionId"], "no")
        result = asking.result()
        self.assertEqual((result["answered"], result["value"], result["approved"]), (True, "no", False))

        key = unique("ask-select")
        asking = Background(lambda: self.p.decisions.ask("Which?", type="select", options=["A", "B"],
                                                         idempotency_key=key, timeout_seconds=30))
        sandbox_answer(pending_decision_with_key(key)["decisionId"], "B")
        result = asking.result()
        # A select counts as approved once answered (the SDK's is_approved).
        self.assertEqual((result["type"], result["value"], result["approved"]), ("select", "B", True))

    def test_ask_that_times_out_stays_answerable(self):
        started = time.monotonic()
        result = self.p.decisions.ask("Nobody answers?", timeout_seconds=2)
        elapsed = time.monotonic() - started
        self.assertGreaterEqual(elapsed, 1.5)
        self.assertLess(elapsed, 10)
        self.assertEqual((result["status"], result["answered"], result["approved"]), ("pending", False, False))
        # "an {"answered": False} return can still be resolved later via get"
        sandbox_answer(result["decisionId"], "yes")
        self.assertEqual(self.p.decisions.get(result["decisionId"], wait=5)["value"], "yes")

    def test_ask_without_key_never_collapses_two_asks(self):
        a = self.p.decisions.ask("Same question?", timeout_seconds=0)
        b = self.p.decisions.ask("Same question?", timeout_seconds=0)
        self.assertNotEqual(a["decisionId"], b["decisionId"])
        keys = {d["decisionId"]: d["idempotencyKey"] for d in sandbox_decisions()}
        self.assertRegex(keys[a["decisionId"]], r"^[0-9a-f]{32}$")

    # -- permits --------------------------------------------------------------

    def test_consume_spends_an_approved_confirm_and_the_first_receipt_wins(self):
        subject = dict(tool_name="refund", tool_target="order-1234", actor="agent-7", environment="test",
                       parameters={"amount": 40, "currency": "EUR", "express": False},
                       external_id=unique("user"))
        decision_id = self.approved_confirm(**subject)
        permit = self.p.consume_authorization(decision_id, subject.pop("tool_name"), **subject)
        self.assertIsInstance(permit["permitId"], str)
        self.assertIsInstance(permit["authority"], str)
        self.assertIsInstance(permit["expiresAt"], str)

        first = self.p.record_execution(permit["permitId"], "succeeded", summary="refunded")
        self.assertEqual(first["outcome"], "succeeded")
        late = self.p.record_execution(permit["permitId"], "failed")
        self.assertEqual(late["outcome"], "succeeded", "a late duplicate cannot rewrite the receipt")
        status, receipt = control("GET", "/receipts/" + quote(permit["permitId"], safe=""))
        self.assertEqual(status, 200)
        self.assertEqual((receipt["outcome"], receipt["summary"], receipt["reports"]), ("succeeded", "refunded", 2))
        self.raises(422, self.p.record_execution, permit["permitId"], "done")
        self.raises(404, self.p.record_execution, "pmt/unknown ü", "failed")

    def assert_refusal(self, refusal, fn, *args, **kwargs):
        with self.assertRaises(PusharyError) as caught:
            fn(*args, **kwargs)
        error = caught.exception
        self.assertEqual(error.body.get("refusal"), refusal, f"{error!r} body={error.body}")
        self.assertIn(error.status, (403, 409))
        self.assertIsInstance(error.message, str)
        # The adapters read the same body.
        expected = REFUSED_REPLAY if refusal == "already_consumed" else f"{error.message} Do not retry the same action."
        self.assertEqual(refused_permit(error), expected)
        return error

    def test_consume_refusal_not_authorized(self):
        consume = self.p.consume_authorization
        self.assert_refusal("not_authorized", consume, "dec_unknown", "refund")
        pending = self.p.decisions.create("Refund?", tool_name="refund")["decisionId"]
        self.assert_refusal("not_authorized", consume, pending, "refund")
        denied = self.p.decisions.create("Refund?", tool_name="refund")["decisionId"]
        sandbox_answer(denied, "no")
        self.assert_refusal("not_authorized", consume, denied, "refund")
        select = self.p.decisions.create("Which?", type="select", options=["a", "b"])["decisionId"]
        sandbox_answer(select, "a")
        self.assert_refusal("not_authorized", consume, select, "refund")

    def test_consume_refusal_action_mismatch(self):
        decision_id = self.approved_confirm(tool_name="refund", parameters={"amount": 40})
        consume = self.p.consume_authorization
        self.assert_refusal("action_mismatch", consume, decision_id, "refund", parameters={"amount": 4000})
        self.assert_refusal("action_mismatch", consume, decision_id, "refund")
        self.assert_refusal("action_mismatch", consume, decision_id, "payout", parameters={"amount": 40})
        # A mismatch spends nothing: the approved action can still be consumed.
        self.assertIn("permitId", consume(decision_id, "refund", parameters={"amount": 40}))

    def test_consume_refusal_already_consumed(self):
        decision_id = self.approved_confirm(tool_name="refund")
        self.p.consume_authorization(decision_id, "refund")
        self.assert_refusal("already_consumed", self.p.consume_authorization, decision_id, "refund")

    def test_consume_refusal_expired(self):
        # The real condition takes the permit lifetime (minutes), so the
        # sandbox is told to refuse the next consume as `expired`.
        decision_id = self.approved_confirm(tool_name="refund")
        status, body = control("POST", f"/decisions/{quote(decision_id, safe='')}/consume-refusal",
                               {"refusal": "expired"})
        self.assertEqual(status, 200, body)
        self.assert_refusal("expired", self.p.consume_authorization, decision_id, "refund")

    def test_adapter_protect_runs_the_action_once(self):
        protect = AdapterKernel("the conformance suite").create_protect(api_key=API_KEY, base_url=BASE_URL,
                                                                        timeout_seconds=30)
        external_id = unique("user")
        call = dict(external_id=external_id, call_id=unique("call"), run_id=unique("run"), target="order-42",
                    facts={"amount": 10, "currency": "EUR"})

        def phone():
            def find():
                for d in sandbox_decisions():
                    if d["externalId"] == external_id and d["status"] == "pending":
                        return d
                return None

            sandbox_answer(wait_until(find, "the gate's decision")["decisionId"], "yes")

        answering = Background(phone)
        ran = []
        result = protect("refund", lambda: ran.append(1) or "done", **call)
        answering.result()
        self.assertTrue(result.ok, result.reason)
        self.assertEqual((result.result, ran), ("done", [1]))
        # The replay reaches the same (already spent) decision and does not run.
        replay = protect("refund", lambda: ran.append(2), **call)
        self.assertFalse(replay.ok)
        self.assertEqual(replay.reason, REFUSED_REPLAY)
        self.assertEqual(ran, [1])

    def test_authorize_asks_a_person_when_no_rule_names_the_action(self):
        evaluation = self.p.evaluate_authorization("refund", tool_target="order-1", parameters={"amount": 5})
        self.assertEqual(evaluation["verdict"], "requires_human")
        self.assertIsNone(evaluation["authorizationId"])

        external_id, key = unique("user"), unique("authorize")
        asking = Background(lambda: self.p.authorize("refund", tool_target="order-1", external_id=external_id,
                                                     idempotency_key=key, timeout_seconds=30))
        decision = pending_decision_with_key(key)
        self.assertEqual(decision["question"], "Approve refund order-1?")
        sandbox_answer(decision["decisionId"], "yes")
        result = asking.result()
        self.assertEqual((result["approved"], result["resolvedBy"], result["reason"], result["decisionId"]),
                         (True, "human", "A person approved it.", decision["decisionId"]))
        # The approved decision is the authorization to spend, for the same subject.
        permit = self.p.consume_authorization(result["decisionId"], "refund", tool_target="order-1",
                                              external_id=external_id)
        self.assertIn("permitId", permit)

        unanswered = self.p.authorize("refund", timeout_seconds=0)
        self.assertEqual((unanswered["approved"], unanswered["reason"]),
                         (False, "Nobody answered, so this was not approved."))

    # -- webhooks -------------------------------------------------------------

    def test_durable_adapter_decision_resumes_from_its_callback(self):
        kernel = AdapterKernel("the conformance suite")
        with self.assertRaises(ValueError):
            kernel.create_durable_decision("Refund?", external_id="u", api_key=API_KEY, base_url=BASE_URL)
        path = self.callback_path()
        created = kernel.create_durable_decision(
            "Refund 40 EUR?", external_id=unique("user"), idempotency_key=unique("run-step"),
            callback_url=self.receiver.url + path, context="run=r-1", api_key=API_KEY, base_url=BASE_URL)
        self.assertEqual(created["correlationId"], created["decisionId"])
        self.assertEqual((created["status"], created["reachable"]), ("pending", True))
        sandbox_answer(created["decisionId"], "yes")
        callback = self.receiver.wait_for(path)[0]
        secret = self.p.decisions.get_webhook_secret()["secret"]
        resolved = resolve_pushary_callback(callback["raw"], callback["signature"], secret)
        self.assertEqual((resolved["correlationId"], resolved["answer"], resolved["approved"], resolved["context"]),
                         (created["correlationId"], "yes", True, "run=r-1"))

    def test_get_webhook_secret(self):
        secret = self.p.decisions.get_webhook_secret()
        self.assertEqual(set(secret), {"secret"})
        status, info = control("GET", "/info")
        self.assertEqual(status, 200)
        self.assertEqual(secret["secret"], info["webhookSecret"])

    def answered_callback(self, answer, **kwargs):
        """Creates a decision with a callback URL, answers it on the phone,
        and returns (decision id, the callback as received)."""
        path = self.callback_path()
        created = self.p.decisions.create("Callback?", callback_url=self.receiver.url + path, **kwargs)
        sandbox_answer(created["decisionId"], answer)
        return created["decisionId"], self.receiver.wait_for(path)[0]

    def test_callbacks_verify_and_parse_with_the_sdk(self):
        secret = self.p.decisions.get_webhook_secret()["secret"]
        decision_id, callback = self.answered_callback("yes", context="thread=t-42", external_id=unique("u"))
        raw, signature = callback["raw"], callback["signature"]
        self.assertEqual(callback["content_type"], "application/json")
        self.assertEqual(SIGNATURE_HEADER, "X-Pushary-Signature")
        self.assertTrue(verify_webhook_signature(raw, signature, secret))
        self.assertFalse(verify_webhook_signature(raw, signature, secret + "x"))
        self.assertFalse(verify_webhook_signature(raw + b" ", signature, secret))
        self.assertFalse(verify_webhook_signature(raw, signature.upper(), secret))

        parsed = parse_decision_callback(raw)
        got = self.p.decisions.get(decision_id)
        self.assertEqual(parsed, {"correlationId": decision_id, "answer": "yes", "value": "yes",
                                  "answeredAt": got["answeredAt"], "context": "thread=t-42"})
        resolved = resolve_pushary_callback(raw, signature, secret)
        self.assertEqual(resolved, {"correlationId": decision_id, "answer": "yes", "value": "yes",
                                    "approved": True, "context": "thread=t-42",
                                    "answeredAt": got["answeredAt"]})
        self.assertIsNone(resolve_pushary_callback(raw, signature, "whsec_wrong"))

    def test_callbacks_without_context_and_for_data_answers(self):
        secret = self.p.decisions.get_webhook_secret()["secret"]
        decision_id, callback = self.answered_callback("Express", type="select", options=["Standard", "Express"])
        parsed = parse_decision_callback(callback["raw"])
        self.assertNotIn("context", parsed)
        self.assertEqual((parsed["correlationId"], parsed["answer"]), (decision_id, "Express"))
        resolved = resolve_pushary_callback(callback["raw"], callback["signature"], secret)
        self.assertIsNone(resolved["context"])
        self.assertIs(resolved["approved"], False)  # data is never permission

        decision_id, callback = self.answered_callback("no")
        resolved = resolve_pushary_callback(callback["raw"], callback["signature"], secret)
        self.assertEqual((resolved["correlationId"], resolved["answer"], resolved["approved"]),
                         (decision_id, "no", False))

    def test_rotated_secret_replaces_the_old_one_at_once(self):
        old = self.p.decisions.get_webhook_secret()["secret"]
        rotated = self.p.decisions.rotate_webhook_secret()
        self.assertEqual(set(rotated), {"secret"})
        new = rotated["secret"]
        self.assertIsInstance(new, str)
        self.assertNotEqual(new, old)
        self.assertEqual(self.p.decisions.get_webhook_secret()["secret"], new)

        decision_id, callback = self.answered_callback("yes")
        raw, signature = callback["raw"], callback["signature"]
        self.assertTrue(verify_webhook_signature(raw, signature, new))
        self.assertFalse(verify_webhook_signature(raw, signature, old), "the old secret must stop verifying")
        self.assertIsNone(resolve_pushary_callback(raw, signature, old))
        self.assertEqual(resolve_pushary_callback(raw, signature, new)["correlationId"], decision_id)


if __name__ == "__main__":
    program = unittest.main(exit=False, verbosity=2)
    result = program.result
    if result.testsRun == 0:
        print("no test ran", file=sys.stderr)
        sys.exit(2)
    sys.exit(0 if result.wasSuccessful() else 1)

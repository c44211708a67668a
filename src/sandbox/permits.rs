//! Permits: spending an approved confirm at most once, for exactly the action
//! that was approved, and the receipt that says what the action did.

use std::time::Duration;

use chrono::{DateTime, Duration as TimeDelta, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use super::error::ApiError;
use super::state::State;
use super::validate::{Kind, SUBJECT_KEYS, string};
use super::views::PermitView;
use super::{Refusal, iso, random_hex};
use crate::domain::keys::canonical_json;

const MAX_SUMMARY_CHARS: usize = 2000;

pub(super) struct Permit {
    pub id: String,
    pub decision_id: String,
    pub issued_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    receipt: Option<Receipt>,
    /// Every receipt call, including the ones that could not rewrite it.
    reports: usize,
}

struct Receipt {
    outcome: String,
    summary: Option<String>,
    recorded_at: DateTime<Utc>,
}

/// The recorded receipt of one permit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReceiptView {
    pub permit_id: String,
    pub decision_id: String,
    pub outcome: String,
    pub summary: Option<String>,
    pub recorded_at: String,
    /// How many receipts were posted for this permit; only the first counts.
    pub reports: usize,
}

impl Permit {
    fn receipt_view(&self) -> Option<ReceiptView> {
        self.receipt.as_ref().map(|r| ReceiptView {
            permit_id: self.id.clone(),
            decision_id: self.decision_id.clone(),
            outcome: r.outcome.clone(),
            summary: r.summary.clone(),
            recorded_at: iso(r.recorded_at),
            reports: self.reports,
        })
    }

    pub fn view(&self) -> PermitView {
        PermitView {
            permit_id: self.id.clone(),
            issued_at: iso(self.issued_at),
            expires_at: iso(self.expires_at),
            receipt: self.receipt_view(),
        }
    }
}

/// The subject keys a request states, nulls treated as absent.
fn stated_subject(body: &Map<String, Value>) -> Map<String, Value> {
    SUBJECT_KEYS
        .iter()
        .filter_map(|&key| body.get(key).filter(|v| !v.is_null()).map(|v| (key.to_string(), v.clone())))
        .collect()
}

/// Same keys present with the same values. Compared as canonical JSON, as the
/// service compares digests: key order never matters, but `1` and `1.0` differ.
pub(super) fn same_subject(recorded: &Map<String, Value>, claimed: &Map<String, Value>) -> bool {
    canonical_json(&Value::Object(recorded.clone())) == canonical_json(&Value::Object(claimed.clone()))
}

impl State {
    pub fn consume_calls(&self, decision_id: &str) -> usize {
        self.consume_calls.get(decision_id).copied().unwrap_or(0)
    }

    pub fn set_forced_refusal(&mut self, decision_id: &str, refusal: Option<Refusal>) {
        match refusal {
            Some(r) => self.forced_refusals.insert(decision_id.to_string(), r),
            None => self.forced_refusals.remove(decision_id),
        };
    }

    pub fn receipt_view(&self, permit_id: &str) -> Option<ReceiptView> {
        self.permits.get(permit_id).and_then(Permit::receipt_view)
    }

    /// `POST /authorizations/consume`. Checks run in a fixed order: approval,
    /// then single use, then the re-stated action, then the time limit.
    pub(super) fn consume(
        &mut self,
        body: &Map<String, Value>,
        ttl: Duration,
        now: DateTime<Utc>,
    ) -> Result<Value, ApiError> {
        let id = string(body, "authorizationId")?
            .filter(|id| !id.is_empty())
            .ok_or_else(|| ApiError::bad_request("authorizationId is required"))?;
        *self.consume_calls.entry(id.clone()).or_default() += 1;
        if let Some(refusal) = self.forced_refusals.remove(&id) {
            return Err(ApiError::refusal(refusal, format!("{} (forced by the sandbox)", refusal.as_str())));
        }

        let Some(decision) = self.decisions.get_mut(&id) else {
            return Err(ApiError::refusal(Refusal::NotAuthorized, "authorization not found"));
        };
        if decision.kind != Kind::Confirm {
            return Err(ApiError::refusal(Refusal::NotAuthorized, "only an approved confirm can be spent"));
        }
        let Some(answered_at) = decision.answer.as_ref().filter(|a| a.value == "yes").map(|a| a.at) else {
            return Err(ApiError::refusal(Refusal::NotAuthorized, "the decision was not approved"));
        };
        if decision.permit_id.is_some() {
            return Err(ApiError::refusal(Refusal::AlreadyConsumed, "authorization already consumed"));
        }
        if !same_subject(&decision.subject, &stated_subject(body)) {
            return Err(ApiError::refusal(
                Refusal::ActionMismatch,
                "the re-stated action does not match the approved one",
            ));
        }
        if (now - answered_at).to_std().unwrap_or(Duration::ZERO) > ttl {
            return Err(ApiError::refusal(Refusal::Expired, "authorization expired"));
        }

        let permit_id = format!("pmt_{}", random_hex(12));
        let expires_at = now + TimeDelta::from_std(ttl).unwrap_or(TimeDelta::MAX);
        decision.permit_id = Some(permit_id.clone());
        self.permits.insert(
            permit_id.clone(),
            Permit {
                id: permit_id.clone(),
                decision_id: id.clone(),
                issued_at: now,
                expires_at,
                receipt: None,
                reports: 0,
            },
        );
        Ok(json!({
            "permitId": permit_id,
            "authorizationId": id,
            // A person approved this on their device; a policy allow would say "policy".
            "authority": "human",
            "expiresAt": iso(expires_at),
        }))
    }

    /// `POST /authorizations/{permitId}/receipt`: the first report wins.
    pub(super) fn receipt(
        &mut self,
        permit_id: &str,
        body: &Map<String, Value>,
        now: DateTime<Utc>,
    ) -> Result<Value, ApiError> {
        let outcome = string(body, "outcome")?;
        let Some(outcome @ ("succeeded" | "failed")) = outcome.as_deref() else {
            return Err(ApiError::invalid("outcome must be \"succeeded\" or \"failed\""));
        };
        let summary = string(body, "summary")?;
        if summary.as_ref().is_some_and(|s| s.chars().count() > MAX_SUMMARY_CHARS) {
            return Err(ApiError::invalid(format!("summary must be at most {MAX_SUMMARY_CHARS} characters")));
        }
        let permit = self.permits.get_mut(permit_id).ok_or_else(|| ApiError::not_found("permit"))?;
        permit.reports += 1;
        let duplicate = permit.receipt.is_some();
        if !duplicate {
            self.receipts_recorded += 1;
        }
        let receipt = permit.receipt.get_or_insert_with(|| Receipt {
            outcome: outcome.to_string(),
            summary,
            recorded_at: now,
        });
        Ok(json!({
            "permitId": permit_id,
            "outcome": receipt.outcome,
            "summary": receipt.summary,
            "recordedAt": iso(receipt.recorded_at),
            "duplicate": duplicate,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::CallbackMode;
    use crate::sandbox::state::Created;
    use crate::sandbox::validate::parse_create;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().cloned().expect("object")
    }

    fn refusal_of(r: Result<Value, ApiError>) -> Value {
        r.expect_err("refused").extra.get("refusal").cloned().unwrap_or(Value::Null)
    }

    #[test]
    fn subject_equality_is_exact() {
        let recorded = obj(json!({"toolName": "refund", "parameters": {"amount": 5, "cur": "EUR"}}));
        assert!(same_subject(
            &recorded,
            &obj(json!({"parameters": {"cur": "EUR", "amount": 5}, "toolName": "refund"}))
        ));
        assert!(!same_subject(&recorded, &obj(json!({"toolName": "refund"}))));
        assert!(!same_subject(
            &recorded,
            &obj(json!({"toolName": "refund", "parameters": {"amount": 5.0, "cur": "EUR"}}))
        ));
        let extra =
            obj(json!({"toolName": "refund", "actor": "a", "parameters": {"amount": 5, "cur": "EUR"}}));
        assert!(!same_subject(&recorded, &extra));
        assert_eq!(
            stated_subject(&obj(json!({"toolName": "x", "actor": null, "authorizationId": "d"}))),
            obj(json!({"toolName": "x"}))
        );
    }

    #[test]
    fn consume_rules() {
        let mut s = State::new("whsec_x".into());
        let now = Utc::now();
        let ttl = Duration::from_secs(600);
        let create = |s: &mut State, body: Value| match s
            .create(parse_create(obj(body)).expect("valid"), "http://h", "u-", now)
            .expect("created")
        {
            Created::New(id) => id,
            Created::Replay(_) => panic!("new"),
        };
        let approved = create(&mut s, json!({"question": "q", "toolName": "refund", "externalId": "e"}));
        let denied = create(&mut s, json!({"question": "q", "toolName": "refund"}));
        let late = create(&mut s, json!({"question": "q", "toolName": "refund"}));
        let select = create(&mut s, json!({"question": "q", "type": "select", "options": ["a", "b"]}));
        s.answer(&approved, "yes", "api", CallbackMode::Drop, now).expect("answer");
        s.answer(&denied, "no", "api", CallbackMode::Drop, now).expect("answer");
        s.answer(&late, "yes", "api", CallbackMode::Drop, now).expect("answer");
        s.answer(&select, "a", "api", CallbackMode::Drop, now).expect("answer");

        let stated = |id: &str| obj(json!({"authorizationId": id, "toolName": "refund", "externalId": "e"}));
        assert_eq!(refusal_of(s.consume(&stated("dec_nope"), ttl, now)), "not_authorized");
        assert_eq!(refusal_of(s.consume(&stated(&denied), ttl, now)), "not_authorized");
        assert_eq!(
            refusal_of(s.consume(&obj(json!({"authorizationId": select})), ttl, now)),
            "not_authorized"
        );
        let mismatch = obj(json!({"authorizationId": approved, "toolName": "refund"}));
        assert_eq!(refusal_of(s.consume(&mismatch, ttl, now)), "action_mismatch");
        let late_body = obj(json!({"authorizationId": late, "toolName": "refund"}));
        assert_eq!(refusal_of(s.consume(&late_body, ttl, now + TimeDelta::seconds(601))), "expired");

        s.set_forced_refusal(&approved, Some(Refusal::Expired));
        assert_eq!(refusal_of(s.consume(&stated(&approved), ttl, now)), "expired");
        let permit = s.consume(&stated(&approved), ttl, now).expect("permit");
        assert_eq!(refusal_of(s.consume(&stated(&approved), ttl, now)), "already_consumed");
        assert_eq!(s.consume_calls(&approved), 4);

        let permit_id = permit["permitId"].as_str().expect("permit id");
        let first = s.receipt(permit_id, &obj(json!({"outcome": "succeeded"})), now).expect("recorded");
        assert_eq!(first["duplicate"], json!(false));
        let second =
            s.receipt(permit_id, &obj(json!({"outcome": "failed", "summary": "x"})), now).expect("kept");
        assert_eq!(
            (second["outcome"].clone(), second["duplicate"].clone()),
            (json!("succeeded"), json!(true))
        );
        assert!(s.receipt(permit_id, &obj(json!({"outcome": "done"})), now).is_err());
        assert!(s.receipt("pmt_nope", &obj(json!({"outcome": "failed"})), now).is_err());
        assert_eq!(s.receipt_view(permit_id).map(|r| (r.outcome, r.reports)), Some(("succeeded".into(), 2)));
    }
}

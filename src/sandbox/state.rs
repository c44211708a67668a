//! The sandbox's memory: decisions, idempotency records and enrollments, and
//! the JSON each decision is shown as. Every method takes `now`, so the rules
//! are testable without waiting for real time to pass.

use std::collections::{HashMap, HashSet};

use axum::http::StatusCode;
use chrono::{DateTime, Duration as TimeDelta, Utc};
use serde_json::{Map, Value, json};

use super::callbacks::{self, CallbackJob};
use super::effect::EffectState;
use super::error::ApiError;
use super::permits::Permit;
use super::validate::{CreateRequest, Kind, check_answer};
use super::views::{CallbackState, CallbackView};
use super::{CallbackMode, Refusal, iso, random_hex};

/// How long an enrollment link stays valid.
const ENROLL_TTL_MINUTES: i64 = 15;

pub(crate) struct State {
    pub webhook_secret: String,
    pub(super) decisions: HashMap<String, Decision>,
    next_seq: u64,
    idempotency: HashMap<String, IdempotencyRecord>,
    pub(super) consume_calls: HashMap<String, usize>,
    pub(super) forced_refusals: HashMap<String, Refusal>,
    pub(super) permits: HashMap<String, Permit>,
    enrollments: HashMap<String, Enrollment>,
    enrolled: HashSet<String>,
    pub effect: EffectState,
    /// Permits with a receipt, kept as a count so load tests can watch it cheaply.
    pub receipts_recorded: usize,
}

pub(super) struct Decision {
    /// Creation order; ids are random, so this is what sorts them.
    pub seq: u64,
    pub id: String,
    pub kind: Kind,
    pub question: String,
    pub options: Option<Vec<String>>,
    /// The subject keys sent at create, exactly as sent.
    pub subject: Map<String, Value>,
    pub callback_url: Option<String>,
    pub context: Option<String>,
    pub agent_name: Option<String>,
    pub placeholder: Option<String>,
    pub presentation: Option<Value>,
    pub idempotency_key: Option<String>,
    pub expires_in_seconds: i64,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    /// `None` when the decision names no recipient.
    pub reachable: Option<bool>,
    pub answer: Option<Answer>,
    pub cancelled_at: Option<DateTime<Utc>>,
    pub callback: CallbackView,
    pub permit_id: Option<String>,
}

pub(super) struct Answer {
    pub value: String,
    pub at: DateTime<Utc>,
    /// Who answered: `api`, `page` or `sandbox` (the handle / control route).
    pub via: String,
}

struct IdempotencyRecord {
    fingerprint: String,
    response: Value,
}

struct Enrollment {
    external_id: String,
    expires_at: DateTime<Utc>,
    used: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Status {
    Pending,
    Answered,
    Expired,
    Cancelled,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Answered => "answered",
            Self::Expired => "expired",
            Self::Cancelled => "cancelled",
        }
    }
}

/// The outcome of a create that did not fail.
#[derive(Debug)]
pub(super) enum Created {
    New(String),
    /// The same idempotency key and payload as an earlier create: its response.
    Replay(Value),
}

impl Decision {
    pub fn status(&self, now: DateTime<Utc>) -> Status {
        if self.answer.is_some() {
            Status::Answered
        } else if self.cancelled_at.is_some() {
            Status::Cancelled
        } else if now >= self.expires_at {
            Status::Expired
        } else {
            Status::Pending
        }
    }

    pub(super) fn subject_str(&self, key: &str) -> Option<String> {
        self.subject.get(key).and_then(Value::as_str).map(str::to_string)
    }

    pub fn external_id(&self) -> Option<String> {
        self.subject_str("externalId")
    }

    /// The `GET /decisions/{id}` shape.
    pub fn json(&self, now: DateTime<Utc>) -> Value {
        json!({
            "decisionId": self.id,
            "status": self.status(now).as_str(),
            "answered": self.answer.is_some(),
            "value": self.answer.as_ref().map(|a| a.value.clone()),
            "type": self.kind.as_str(),
            "question": self.question,
            "options": self.options,
            "externalId": self.external_id(),
            "createdAt": iso(self.created_at),
            "answeredAt": self.answer.as_ref().map(|a| iso(a.at)),
            "expiresAt": iso(self.expires_at),
        })
    }

    /// The `POST /decisions` shape.
    pub fn create_json(&self, public_url: &str, now: DateTime<Utc>) -> Value {
        let mut body = json!({
            "decisionId": self.id,
            "status": self.status(now).as_str(),
            "type": self.kind.as_str(),
            "question": self.question,
            "decisionPageUrl": format!("{public_url}/d/{}", self.id),
            "pollUrl": format!("{public_url}/api/v1/server/decisions/{}", self.id),
            "expiresInSeconds": self.expires_in_seconds,
            "answered": self.answer.is_some(),
            "value": self.answer.as_ref().map(|a| a.value.clone()),
        });
        if let (Some(reachable), Some(map)) = (self.reachable, body.as_object_mut()) {
            map.extend(reachability(reachable));
        }
        body
    }
}

/// The recipient fields of a create response. The sandbox models one device
/// with the push channel per reachable recipient.
fn reachability(reachable: bool) -> Map<String, Value> {
    let channels: Vec<&str> = if reachable { vec!["push"] } else { vec![] };
    let mut map = Map::new();
    map.insert("reachable".into(), json!(reachable));
    map.insert("reachableChannels".into(), json!(channels));
    map.insert("deviceCount".into(), json!(usize::from(reachable)));
    map
}

impl State {
    pub fn new(webhook_secret: String) -> Self {
        Self {
            webhook_secret,
            decisions: HashMap::new(),
            receipts_recorded: 0,
            next_seq: 0,
            idempotency: HashMap::new(),
            consume_calls: HashMap::new(),
            forced_refusals: HashMap::new(),
            permits: HashMap::new(),
            enrollments: HashMap::new(),
            enrolled: HashSet::new(),
            effect: EffectState::default(),
        }
    }

    pub(super) fn decision(&self, id: &str) -> Option<&Decision> {
        self.decisions.get(id)
    }

    /// When the next pending decision expires, if any is pending.
    pub(super) fn next_expiry(&self, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.decisions.values().filter(|d| d.status(now) == Status::Pending).map(|d| d.expires_at).min()
    }

    fn is_reachable(&self, external_id: &str, unreachable_prefix: &str) -> bool {
        self.enrolled.contains(external_id)
            || unreachable_prefix.is_empty()
            || !external_id.starts_with(unreachable_prefix)
    }

    pub(super) fn create(
        &mut self,
        req: CreateRequest,
        public_url: &str,
        unreachable_prefix: &str,
        now: DateTime<Utc>,
    ) -> Result<Created, ApiError> {
        if let Some(key) = &req.idempotency_key
            && let Some(record) = self.idempotency.get(key)
        {
            return if record.fingerprint == req.fingerprint {
                Ok(Created::Replay(record.response.clone()))
            } else {
                Err(ApiError::conflict(
                    "idempotency key reused with a different payload",
                    "A retry must resend the identical payload; use a new key for a new decision.",
                ))
            };
        }
        let reachable = req.external_id().map(|id| self.is_reachable(id, unreachable_prefix));
        if req.require_reachable && reachable == Some(false) {
            let mut error = ApiError::conflict(
                "recipient is not reachable",
                "The end-user has no enrolled device or push subscription, so no decision was created.",
            );
            error.extra.extend(reachability(false));
            return Err(error);
        }

        self.next_seq += 1;
        let id = format!("dec_{}", random_hex(12));
        let callback = CallbackView {
            state: if req.callback_url.is_some() {
                CallbackState::Waiting
            } else {
                CallbackState::NoCallbackUrl
            },
            attempts: 0,
            last_status: None,
            last_error: None,
            delivered_at: None,
            body: None,
        };
        let decision = Decision {
            seq: self.next_seq,
            id: id.clone(),
            kind: req.kind,
            question: req.question,
            options: req.options,
            subject: req.subject,
            callback_url: req.callback_url,
            context: req.context,
            agent_name: req.agent_name,
            placeholder: req.placeholder,
            presentation: req.presentation,
            idempotency_key: req.idempotency_key.clone(),
            expires_in_seconds: req.expires_in_seconds,
            created_at: now,
            expires_at: now + TimeDelta::seconds(req.expires_in_seconds),
            reachable,
            answer: None,
            cancelled_at: None,
            callback,
            permit_id: None,
        };
        if let Some(key) = req.idempotency_key {
            let response = decision.create_json(public_url, now);
            self.idempotency.insert(key, IdempotencyRecord { fingerprint: req.fingerprint, response });
        }
        self.decisions.insert(id.clone(), decision);
        Ok(Created::New(id))
    }

    /// Records an answer; returns the decision's JSON and the callback to
    /// deliver, if any.
    pub(super) fn answer(
        &mut self,
        id: &str,
        value: &str,
        via: &str,
        mode: CallbackMode,
        now: DateTime<Utc>,
    ) -> Result<(Value, Option<CallbackJob>), ApiError> {
        let decision = self.decisions.get_mut(id).ok_or_else(|| ApiError::not_found("decision"))?;
        let status = decision.status(now);
        if status != Status::Pending {
            return Err(ApiError::conflict(
                format!("decision is {}", status.as_str()),
                "Only a pending decision can be answered.",
            ));
        }
        check_answer(decision.kind, decision.options.as_deref(), value)?;
        decision.answer = Some(Answer { value: value.to_string(), at: now, via: via.to_string() });

        let mut job = None;
        if let Some(url) = &decision.callback_url {
            let body = callbacks::body(id, value, now, decision.context.as_deref());
            decision.callback.body = Some(String::from_utf8_lossy(&body).into_owned());
            match mode {
                CallbackMode::Send => {
                    decision.callback.state = CallbackState::Sending;
                    job = Some(CallbackJob { decision_id: id.to_string(), url: url.clone(), body });
                }
                CallbackMode::Drop => decision.callback.state = CallbackState::Dropped,
            }
        }
        Ok((decision.json(now), job))
    }

    pub(super) fn cancel(&mut self, id: &str, now: DateTime<Utc>) -> Result<Value, ApiError> {
        let decision = self.decisions.get_mut(id).ok_or_else(|| ApiError::not_found("decision"))?;
        let status = decision.status(now);
        if status == Status::Pending {
            decision.cancelled_at = Some(now);
        }
        // Cancelling twice is not an error: the decision is cancelled either way.
        let cancelled = matches!(status, Status::Pending | Status::Cancelled);
        Ok(json!({
            "decisionId": id,
            "cancelled": cancelled,
            "status": decision.status(now).as_str(),
        }))
    }

    pub(super) fn enroll(&mut self, external_id: String, public_url: &str, now: DateTime<Utc>) -> Value {
        let token = random_hex(16);
        let expires_at = now + TimeDelta::minutes(ENROLL_TTL_MINUTES);
        let body = json!({
            "universalLink": format!("{public_url}/enroll/{token}"),
            "externalId": external_id,
            "expiresAt": iso(expires_at),
        });
        self.enrollments.insert(token, Enrollment { external_id, expires_at, used: false });
        body
    }

    /// Opens an enrollment link: the recipient becomes reachable. Single use.
    pub(super) fn redeem_enrollment(&mut self, token: &str, now: DateTime<Utc>) -> Result<String, ApiError> {
        let enrollment =
            self.enrollments.get_mut(token).ok_or_else(|| ApiError::not_found("enrollment link"))?;
        if enrollment.used || now >= enrollment.expires_at {
            return Err(ApiError::new(
                StatusCode::GONE,
                "enrollment link already used or expired",
                "Create a new link with POST /enroll.",
            ));
        }
        enrollment.used = true;
        self.enrolled.insert(enrollment.external_id.clone());
        Ok(enrollment.external_id.clone())
    }

    pub(super) fn rotate_webhook_secret(&mut self) -> String {
        self.webhook_secret = super::new_webhook_secret();
        self.webhook_secret.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::validate::parse_create;

    fn req(body: Value) -> CreateRequest {
        parse_create(body.as_object().cloned().expect("object")).expect("valid request")
    }

    fn new_id(created: Created) -> String {
        match created {
            Created::New(id) => id,
            Created::Replay(_) => panic!("expected a new decision"),
        }
    }

    #[test]
    fn idempotency_replays_or_conflicts() {
        let mut s = State::new("whsec_x".into());
        let now = Utc::now();
        let body = json!({"question": "q", "idempotencyKey": "k", "externalId": "u"});
        let id = new_id(s.create(req(body.clone()), "http://h", "unreachable", now).expect("created"));
        let first = s.decision(&id).expect("stored").create_json("http://h", now);

        let mut waiting = body.clone();
        waiting["wait"] = json!(true);
        match s.create(req(waiting), "http://h", "unreachable", now).expect("replayed") {
            Created::Replay(response) => assert_eq!(response, first),
            Created::New(_) => panic!("a retry must not create a second decision"),
        }
        let changed = json!({"question": "q2", "idempotencyKey": "k", "externalId": "u"});
        let err = s.create(req(changed), "http://h", "unreachable", now).expect_err("conflict");
        assert_eq!(err.status, StatusCode::CONFLICT);
        assert_eq!(err.error, "idempotency key reused with a different payload");
        assert_eq!(s.decisions.len(), 1);
    }

    #[test]
    fn unreachable_recipients_get_no_decision_unless_enrolled() {
        let mut s = State::new("whsec_x".into());
        let now = Utc::now();
        let body = json!({"question": "q", "externalId": "unreachable-1", "requireReachable": true});
        let err = s.create(req(body.clone()), "http://h", "unreachable", now).expect_err("409");
        assert_eq!(err.status, StatusCode::CONFLICT);
        assert_eq!(err.extra.get("reachable"), Some(&json!(false)));
        assert!(s.decisions.is_empty());

        let link = s.enroll("unreachable-1".into(), "http://h", now);
        let token = link["universalLink"].as_str().and_then(|l| l.rsplit('/').next()).expect("token");
        assert_eq!(s.redeem_enrollment(token, now).expect("first use"), "unreachable-1");
        assert!(s.redeem_enrollment(token, now).is_err(), "links are single use");
        new_id(s.create(req(body), "http://h", "unreachable", now).expect("now reachable"));
    }

    #[test]
    fn status_answers_and_cancel() {
        let mut s = State::new("whsec_x".into());
        let now = Utc::now();
        let body =
            json!({"question": "q", "expiresInSeconds": 60, "callbackUrl": "http://cb/x", "context": "c"});
        let a = new_id(s.create(req(body.clone()), "http://h", "u", now).expect("created"));
        let b = new_id(s.create(req(body.clone()), "http://h", "u", now).expect("created"));
        let c = new_id(s.create(req(body), "http://h", "u", now).expect("created"));

        assert!(s.answer(&a, "Yes", "api", CallbackMode::Send, now).is_err());
        let (json, job) = s.answer(&a, "yes", "api", CallbackMode::Send, now).expect("answered");
        assert_eq!(json["status"], "answered");
        assert!(job.is_some());
        let again = s.answer(&a, "no", "api", CallbackMode::Send, now).expect_err("409");
        assert_eq!(again.status, StatusCode::CONFLICT);
        assert_eq!(s.cancel(&a, now).expect("reported")["cancelled"], json!(false));

        let (_, job) = s.answer(&b, "no", "page", CallbackMode::Drop, now).expect("answered");
        assert!(job.is_none());
        assert_eq!(s.decision(&b).expect("b").callback.state, CallbackState::Dropped);

        let later = now + TimeDelta::seconds(61);
        assert_eq!(s.decision(&c).expect("c").status(later), Status::Expired);
        assert!(s.answer(&c, "yes", "api", CallbackMode::Send, later).is_err());
        assert_eq!(
            s.cancel(&c, later).expect("reported"),
            json!({"decisionId": c, "cancelled": false, "status": "expired"})
        );
        let d = new_id(s.create(req(json!({"question": "q"})), "http://h", "u", now).expect("created"));
        assert_eq!(s.cancel(&d, now).expect("cancelled")["cancelled"], json!(true));
        assert_eq!(s.cancel(&d, now).expect("again")["status"], json!("cancelled"));
    }
}

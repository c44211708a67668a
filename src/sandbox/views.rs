//! How the sandbox shows its state to tests and the page: plain serializable
//! snapshots, detached from the live state.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::iso;
use super::permits::{Permit, ReceiptView};
use super::state::{Decision, State};

/// Where a decision's callback stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallbackState {
    /// The decision was created without a `callbackUrl`.
    NoCallbackUrl,
    /// Not answered yet.
    Waiting,
    /// Being delivered (retrying until a 2xx).
    Sending,
    Delivered,
    /// Retries exhausted without a 2xx.
    GaveUp,
    /// Answered with `CallbackMode::Drop`: the callback was deliberately lost.
    Dropped,
    /// The sandbox shut down before a 2xx.
    Stopped,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CallbackView {
    pub state: CallbackState,
    pub attempts: u32,
    pub last_status: Option<u16>,
    pub last_error: Option<String>,
    pub delivered_at: Option<String>,
    /// The exact body sent (or that would have been sent, when dropped).
    pub body: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PermitView {
    pub permit_id: String,
    pub issued_at: String,
    pub expires_at: String,
    pub receipt: Option<ReceiptView>,
}

/// Everything the sandbox knows about one decision.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DecisionView {
    pub decision_id: String,
    pub status: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub question: String,
    pub options: Option<Vec<String>>,
    pub external_id: Option<String>,
    pub tool_name: Option<String>,
    pub tool_target: Option<String>,
    pub actor: Option<String>,
    pub environment: Option<String>,
    pub parameters: Option<Value>,
    pub callback_url: Option<String>,
    pub context: Option<String>,
    pub agent_name: Option<String>,
    pub placeholder: Option<String>,
    pub presentation: Option<Value>,
    pub idempotency_key: Option<String>,
    pub expires_in_seconds: i64,
    pub reachable: Option<bool>,
    pub created_at: String,
    pub expires_at: String,
    pub answered: bool,
    pub value: Option<String>,
    pub answered_at: Option<String>,
    pub answered_via: Option<String>,
    pub cancelled_at: Option<String>,
    pub callback: CallbackView,
    pub consume_calls: usize,
    pub permit: Option<PermitView>,
}

impl Decision {
    fn view(&self, consume_calls: usize, permit: Option<&Permit>, now: DateTime<Utc>) -> DecisionView {
        DecisionView {
            decision_id: self.id.clone(),
            status: self.status(now).as_str().to_string(),
            kind: self.kind.as_str().to_string(),
            question: self.question.clone(),
            options: self.options.clone(),
            external_id: self.external_id(),
            tool_name: self.subject_str("toolName"),
            tool_target: self.subject_str("toolTarget"),
            actor: self.subject_str("actor"),
            environment: self.subject_str("environment"),
            parameters: self.subject.get("parameters").cloned(),
            callback_url: self.callback_url.clone(),
            context: self.context.clone(),
            agent_name: self.agent_name.clone(),
            placeholder: self.placeholder.clone(),
            presentation: self.presentation.clone(),
            idempotency_key: self.idempotency_key.clone(),
            expires_in_seconds: self.expires_in_seconds,
            reachable: self.reachable,
            created_at: iso(self.created_at),
            expires_at: iso(self.expires_at),
            answered: self.answer.is_some(),
            value: self.answer.as_ref().map(|a| a.value.clone()),
            answered_at: self.answer.as_ref().map(|a| iso(a.at)),
            answered_via: self.answer.as_ref().map(|a| a.via.clone()),
            cancelled_at: self.cancelled_at.map(iso),
            callback: self.callback.clone(),
            consume_calls,
            permit: permit.map(Permit::view),
        }
    }
}

impl State {
    pub fn decision_views(&self, now: DateTime<Utc>) -> Vec<DecisionView> {
        let mut decisions: Vec<&Decision> = self.decisions.values().collect();
        decisions.sort_by_key(|d| d.seq);
        decisions.into_iter().map(|d| self.view_of(d, now)).collect()
    }

    pub fn decision_view(&self, id: &str, now: DateTime<Utc>) -> Option<DecisionView> {
        self.decisions.get(id).map(|d| self.view_of(d, now))
    }

    fn view_of(&self, d: &Decision, now: DateTime<Utc>) -> DecisionView {
        let permit = d.permit_id.as_ref().and_then(|p| self.permits.get(p));
        d.view(self.consume_calls(&d.id), permit, now)
    }
}

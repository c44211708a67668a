//! The sandbox page: pending decisions with the buttons the phone would show,
//! recent outcomes, and what the example effect target received. Plain
//! server-rendered HTML with forms; every value is escaped.

use std::fmt::Write as _;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use chrono::{DateTime, Utc};
use serde_json::Value;

use super::state::Status;
use super::views::DecisionView;
use super::{CallbackMode, EffectDeliveryView, Shared, answer_decision};

/// How many finished decisions and deliveries the page lists.
const RECENT: usize = 50;

pub(super) fn router() -> Router<Arc<Shared>> {
    Router::new()
        .route("/", get(index))
        .route("/d/{id}", get(decision_page))
        .route("/sandbox/decisions/{id}/answer", post(answer))
        .route("/enroll/{token}", get(enroll))
}

#[derive(serde::Deserialize)]
struct Notice {
    error: Option<String>,
}

async fn index(State(shared): State<Arc<Shared>>, Query(notice): Query<Notice>) -> Html<String> {
    let now = Utc::now();
    let (decisions, deliveries) = {
        let state = shared.lock();
        (state.decision_views(now), state.effect.deliveries.clone())
    };
    let mut body = String::new();
    banner(&mut body, notice.error.as_deref());

    let pending: Vec<&DecisionView> =
        decisions.iter().rev().filter(|d| d.status == Status::Pending.as_str()).collect();
    let _ = write!(body, "<h2>Pending ({})</h2>", pending.len());
    if pending.is_empty() {
        body.push_str(
            "<p class=muted>Nothing to answer. Decisions created against this sandbox appear here.</p>",
        );
    }
    for d in pending {
        card(&mut body, d, now, "/");
    }

    body.push_str("<h2>Recent</h2>");
    let finished: Vec<&DecisionView> =
        decisions.iter().rev().filter(|d| d.status != Status::Pending.as_str()).take(RECENT).collect();
    if finished.is_empty() {
        body.push_str("<p class=muted>No answered, expired or cancelled decisions yet.</p>");
    } else {
        recent_table(&mut body, &finished);
    }

    body.push_str("<h2>Example effect target</h2>");
    let _ = write!(
        body,
        "<p class=muted>Deliveries to <code>{}</code></p>",
        esc(&format!("{}/sandbox/effect", shared.public_url))
    );
    effect_table(&mut body, &deliveries);
    Html(layout("Pushary sandbox", &body))
}

async fn decision_page(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    Query(notice): Query<Notice>,
) -> Response {
    let now = Utc::now();
    let Some(d) = shared.lock().decision_view(&id, now) else {
        return (StatusCode::NOT_FOUND, Html(layout("Not found", "<p>No decision with that id.</p>")))
            .into_response();
    };
    let mut body = String::new();
    banner(&mut body, notice.error.as_deref());
    if d.status == Status::Pending.as_str() {
        card(&mut body, &d, now, &format!("/d/{id}"));
    } else {
        recent_table(&mut body, &[&d]);
    }
    body.push_str("<p><a href=\"/\">All decisions</a></p>");
    Html(layout("Decision", &body)).into_response()
}

/// The page's answer buttons post here; the answer goes through the same path
/// as the API, callback included, then the browser goes back.
async fn answer(State(shared): State<Arc<Shared>>, Path(id): Path<String>, body: Bytes) -> Redirect {
    let mut answer = None;
    let mut back = "/".to_string();
    for (key, value) in url::form_urlencoded::parse(&body) {
        match &*key {
            "answer" => answer = Some(value.into_owned()),
            // Only local paths, so the form cannot be turned into an open redirect.
            "back" if value.starts_with('/') && !value.starts_with("//") => back = value.into_owned(),
            _ => {}
        }
    }
    let result = match answer {
        Some(answer) => answer_decision(&shared, &id, &answer, "page", CallbackMode::Send).map(|_| ()),
        None => Err(super::error::ApiError::invalid("no answer was submitted")),
    };
    match result {
        Ok(()) => Redirect::to(&back),
        Err(error) => {
            let message: String = url::form_urlencoded::byte_serialize(error.message().as_bytes()).collect();
            Redirect::to(&format!("{back}?error={message}"))
        }
    }
}

async fn enroll(State(shared): State<Arc<Shared>>, Path(token): Path<String>) -> Response {
    match shared.mutate(|s| s.redeem_enrollment(&token, Utc::now())) {
        Ok(external_id) => {
            let body = format!(
                "<p>Phone connected for <b>{}</b>. Decisions for this recipient are now reachable.</p>\
                 <p><a href=\"/\">Back to the sandbox</a></p>",
                esc(&external_id)
            );
            Html(layout("Enrolled", &body)).into_response()
        }
        Err(error) => {
            (error.status, Html(layout("Enrollment", &format!("<p>{}</p>", esc(&error.message())))))
                .into_response()
        }
    }
}

fn banner(out: &mut String, error: Option<&str>) {
    if let Some(error) = error {
        let _ = write!(out, "<p class=error>{}</p>", esc(error));
    }
}

fn card(out: &mut String, d: &DecisionView, now: DateTime<Utc>, back: &str) {
    let _ = write!(out, "<section class=card><h3>{}</h3><dl>", esc(&d.question));
    let recipient = d.external_id.as_deref().unwrap_or("(site owner)");
    let reach = match d.reachable {
        Some(false) => " <span class=warn>unreachable</span>",
        _ => "",
    };
    let _ = write!(out, "<dt>To</dt><dd>{}{reach}</dd>", esc(recipient));
    for (label, value) in [
        ("Agent", &d.agent_name),
        ("Tool", &d.tool_name),
        ("Target", &d.tool_target),
        ("Actor", &d.actor),
        ("Environment", &d.environment),
        ("Context", &d.context),
    ] {
        if let Some(value) = value {
            let _ = write!(out, "<dt>{label}</dt><dd>{}</dd>", esc(value));
        }
    }
    if let Some(Value::Object(parameters)) = &d.parameters {
        out.push_str("<dt>Parameters</dt><dd><ul class=params>");
        for (key, value) in parameters {
            let shown = value.as_str().map_or_else(|| value.to_string(), str::to_string);
            let _ = write!(out, "<li><code>{}</code> = {}</li>", esc(key), esc(&shown));
        }
        out.push_str("</ul></dd>");
    }
    let _ = write!(
        out,
        "<dt>Expires in</dt><dd>{}</dd><dt>Id</dt><dd><code>{}</code></dd></dl>",
        time_left(&d.expires_at, now),
        esc(&d.decision_id)
    );
    let _ = write!(
        out,
        "<form method=post action=\"/sandbox/decisions/{}/answer\"><input type=hidden name=back value=\"{}\">",
        esc(&d.decision_id),
        esc(back)
    );
    match d.kind.as_str() {
        "confirm" => out.push_str(
            "<button class=approve name=answer value=yes>Approve</button> \
             <button class=deny name=answer value=no>Deny</button>",
        ),
        "select" => {
            for option in d.options.iter().flatten() {
                let _ = write!(out, "<button name=answer value=\"{0}\">{0}</button> ", esc(option));
            }
        }
        _ => {
            let _ = write!(
                out,
                "<input type=text name=answer required maxlength=5000 placeholder=\"{}\"> <button>Send</button>",
                esc(d.placeholder.as_deref().unwrap_or("Your answer"))
            );
        }
    }
    out.push_str("</form></section>");
}

fn recent_table(out: &mut String, decisions: &[&DecisionView]) {
    out.push_str(
        "<table><tr><th>Question</th><th>To</th><th>Status</th><th>Answer</th><th>When</th>\
         <th>Callback</th><th>Permit</th></tr>",
    );
    for d in decisions {
        let when = d.answered_at.as_ref().or(d.cancelled_at.as_ref()).unwrap_or(&d.expires_at);
        let callback = format!(
            "{:?} ({} attempts{})",
            d.callback.state,
            d.callback.attempts,
            d.callback.last_status.map(|s| format!(", last {s}")).unwrap_or_default()
        );
        let permit = match &d.permit {
            None => format!("{} consume calls", d.consume_calls),
            Some(p) => format!(
                "{} · {}",
                p.permit_id,
                p.receipt.as_ref().map_or("no receipt", |r| r.outcome.as_str())
            ),
        };
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&d.question),
            esc(d.external_id.as_deref().unwrap_or("")),
            esc(&d.status),
            esc(d.value.as_deref().unwrap_or("")),
            esc(when),
            esc(&callback),
            esc(&permit)
        );
    }
    out.push_str("</table>");
}

fn effect_table(out: &mut String, deliveries: &[EffectDeliveryView]) {
    if deliveries.is_empty() {
        out.push_str("<p class=muted>No deliveries yet.</p>");
        return;
    }
    out.push_str(
        "<table><tr><th>#</th><th>Received</th><th>HTTP</th><th>Outcome</th><th>Approved</th>\
         <th>Operation</th><th>Verified</th><th>Effect</th><th>Idempotency key</th></tr>",
    );
    for d in deliveries.iter().rev().take(RECENT) {
        let field =
            |key: &str| d.body.get(key).map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_string));
        let effect = if d.executed {
            "executed".to_string()
        } else if d.replay {
            "replay (not re-run)".to_string()
        } else {
            d.error.clone().unwrap_or_else(|| "not run".to_string())
        };
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            d.seq,
            esc(&d.received_at),
            d.status,
            esc(&field("status").unwrap_or_default()),
            esc(&field("approved").unwrap_or_default()),
            esc(&field("operationId").unwrap_or_default()),
            if d.verified { "yes" } else { "no" },
            esc(&effect),
            esc(d.idempotency_key.as_deref().unwrap_or(""))
        );
    }
    out.push_str("</table>");
}

fn time_left(expires_at: &str, now: DateTime<Utc>) -> String {
    let Ok(at) = DateTime::parse_from_rfc3339(expires_at) else {
        return esc(expires_at);
    };
    let secs = (at.with_timezone(&Utc) - now).num_seconds().max(0);
    match secs {
        0..60 => format!("{secs}s"),
        60..3600 => format!("{}m {}s", secs / 60, secs % 60),
        _ => format!("{}h {}m", secs / 3600, secs % 3600 / 60),
    }
}

/// Reloads every 2 s so answers from elsewhere show up, except while the
/// developer is typing an input answer, which a reload would wipe.
const REFRESH_SCRIPT: &str = "setInterval(function(){var a=document.activeElement;\
var typing=Array.prototype.some.call(document.querySelectorAll('input[type=text]'),function(i){return i.value;});\
if(!(a&&a.tagName==='INPUT')&&!typing){location.replace(location.pathname);}},2000);";

const STYLE: &str = "body{font-family:system-ui,sans-serif;max-width:60rem;margin:1rem auto;padding:0 1rem;color:#222}\
.card{border:1px solid #ccc;border-radius:8px;padding:.5rem 1rem;margin:.75rem 0}\
dl{display:grid;grid-template-columns:8rem 1fr;gap:.2rem .5rem}dt{color:#666}dd{margin:0}\
button{font-size:1rem;padding:.4rem .9rem;border-radius:6px;border:1px solid #888;cursor:pointer}\
.approve{background:#1a7f37;color:#fff}.deny{background:#cf222e;color:#fff}\
table{border-collapse:collapse;width:100%;font-size:.9rem}td,th{border-bottom:1px solid #ddd;padding:.25rem;text-align:left}\
.muted{color:#777}.error{background:#ffebe9;border:1px solid #cf222e;padding:.5rem}.warn{color:#cf222e}\
.params{margin:0;padding-left:1rem}";

fn layout(title: &str, body: &str) -> String {
    format!(
        "<!doctype html><html><head><meta charset=utf-8><title>{}</title>\
         <meta name=viewport content=\"width=device-width,initial-scale=1\">\
         <noscript><meta http-equiv=refresh content=2></noscript><style>{STYLE}</style></head>\
         <body><h1>Pushary sandbox</h1>{body}<script>{REFRESH_SCRIPT}</script></body></html>",
        esc(title)
    )
}

pub(super) use crate::html::esc;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_left_is_readable() {
        let now = DateTime::parse_from_rfc3339("2026-11-29T09:00:00Z").expect("valid").with_timezone(&Utc);
        let at = |s: i64| super::super::iso(now + chrono::Duration::seconds(s));
        assert_eq!(time_left(&at(30), now), "30s");
        assert_eq!(time_left(&at(125), now), "2m 5s");
        assert_eq!(time_left(&at(-5), now), "0s");
    }
}

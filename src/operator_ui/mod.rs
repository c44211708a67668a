//! The operator page at `/operator`: what waits on whom, what failed, and
//! the `uncertain` queue with its resolve action, for every tenant.
//!
//! People sign in with `operator.token` once; the page then keeps a session
//! cookie (HttpOnly, SameSite=Strict, 12 hours) that holds a MAC of its
//! issue time under the token, never the token. `Authorization: Bearer
//! <operator token>` works too, for scripts. With no token configured the
//! page does not exist (404). Forms post back with the cookie; SameSite and
//! an Origin check keep other sites from posting for the operator.

mod html;

use std::collections::HashMap;

use axum::Router;
use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::api::{AppState, constant_time_eq, read_body};
use crate::clock::now_ms;
use crate::error::ApiError;
use crate::store::OperatorFilter;

const COOKIE: &str = "approvald_operator";
const SESSION_MS: i64 = 12 * 3600 * 1000;
const CHART_MINUTES: i64 = 60;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/operator", get(overview))
        .route("/operator/login", get(login_form).post(login))
        .route("/operator/logout", post(logout))
        .route("/operator/operations", get(operations))
        .route("/operator/operations/{id}", get(operation))
        .route("/operator/operations/{id}/resolve", post(resolve))
        .route("/operator/inbox", get(inbox))
}

fn session_mac(token: &str, issued: i64) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(token.as_bytes()).expect("HMAC takes any key length");
    mac.update(format!("approvald operator session {issued}").as_bytes());
    hex::encode(mac.finalize().into_bytes())
}

/// Why a request may not see the page.
enum Denied {
    /// No operator token configured: the page does not exist.
    Off,
    SignIn,
}

impl IntoResponse for Denied {
    fn into_response(self) -> Response {
        match self {
            Denied::Off => ApiError::NotFound { detail: "no such route".into() }.into_response(),
            Denied::SignIn => Redirect::to("/operator/login").into_response(),
        }
    }
}

fn operator_token(state: &AppState) -> Option<&str> {
    state.config.operator.token.as_ref().map(|t| t.expose())
}

fn check(state: &AppState, headers: &HeaderMap) -> Result<(), Denied> {
    let token = operator_token(state).ok_or(Denied::Off)?;
    if let Some(given) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    {
        return if constant_time_eq(given.as_bytes(), token.as_bytes()) {
            Ok(())
        } else {
            Err(Denied::SignIn)
        };
    }
    let cookie = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().strip_prefix(&format!("{COOKIE}=")).map(str::to_string))
        .next()
        .ok_or(Denied::SignIn)?;
    let (issued, mac) = cookie.split_once('.').ok_or(Denied::SignIn)?;
    let issued: i64 = issued.parse().map_err(|_| Denied::SignIn)?;
    let fresh = (0..SESSION_MS).contains(&(now_ms() - issued));
    if fresh && constant_time_eq(session_mac(token, issued).as_bytes(), mac.as_bytes()) {
        Ok(())
    } else {
        Err(Denied::SignIn)
    }
}

/// A request from a signed-in operator; anyone else is sent to sign in
/// (or gets 404 when the page is off).
struct Operator;

impl axum::extract::FromRequestParts<AppState> for Operator {
    type Rejection = Denied;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &AppState,
    ) -> Result<Self, Denied> {
        check(state, &parts.headers).map(|()| Operator)
    }
}

fn secure_cookie(state: &AppState) -> &'static str {
    if state.config.server.public_url.starts_with("https://") { "; Secure" } else { "" }
}

/// A form post must come from this page: a browser names the origin of a
/// cross-site post, and it must be ours.
fn same_origin(headers: &HeaderMap) -> bool {
    let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) else { return true };
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok()).unwrap_or("");
    origin.split_once("://").is_some_and(|(_, rest)| rest == host)
}

fn form(bytes: &[u8]) -> HashMap<String, String> {
    url::form_urlencoded::parse(bytes).into_owned().collect()
}

async fn login_form(State(state): State<AppState>) -> Response {
    if operator_token(&state).is_none() {
        return Denied::Off.into_response();
    }
    Html(html::login(None)).into_response()
}

async fn login(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let Some(token) = operator_token(&state) else { return Ok(Denied::Off.into_response()) };
    if !same_origin(&headers) {
        return Ok(
            (StatusCode::FORBIDDEN, Html(html::login(Some("cross-site sign-in refused")))).into_response()
        );
    }
    let fields = form(&read_body(body, 4096).await?);
    let given = fields.get("token").map_or("", String::as_str);
    if !constant_time_eq(given.as_bytes(), token.as_bytes()) {
        tracing::warn!("operator sign-in refused: wrong token");
        return Ok((StatusCode::UNAUTHORIZED, Html(html::login(Some("That is not the operator token."))))
            .into_response());
    }
    let issued = now_ms();
    let cookie = format!(
        "{COOKIE}={issued}.{}; Path=/operator; HttpOnly; SameSite=Strict; Max-Age={}{}",
        session_mac(token, issued),
        SESSION_MS / 1000,
        secure_cookie(&state)
    );
    let mut resp = Redirect::to("/operator").into_response();
    resp.headers_mut().insert(header::SET_COOKIE, HeaderValue::from_str(&cookie).expect("ASCII cookie"));
    Ok(resp)
}

async fn logout() -> Response {
    let mut resp = Redirect::to("/operator/login").into_response();
    let cookie = format!("{COOKIE}=; Path=/operator; HttpOnly; SameSite=Strict; Max-Age=0");
    resp.headers_mut().insert(header::SET_COOKIE, HeaderValue::from_str(&cookie).expect("ASCII cookie"));
    resp
}

async fn overview(_: Operator, State(state): State<AppState>) -> Result<Response, ApiError> {
    let store = state.engine.store();
    let now = now_ms();
    let counts = store.operation_counts().await?;
    let (waiting, orphaned, oldest) = store.inbox_depth().await?;
    let activity = store.activity(now - CHART_MINUTES * 60_000).await?;
    let uncertain = store
        .operator_operations(&OperatorFilter {
            state: Some("uncertain".into()),
            limit: 100,
            ..Default::default()
        })
        .await?;
    let mut body = String::from("<div class=\"cards\" id=\"counts\">");
    for (s, n) in &counts {
        body.push_str(&format!(
            "<a class=\"card\" href=\"/operator/operations?state={}\"><b>{n}</b>{}</a>",
            html::enc(s),
            html::state_badge(s)
        ));
    }
    body.push_str(&format!(
        "<a class=\"card\" href=\"/operator/inbox?state=new\"><b>{waiting}</b>inbox waiting{}</a>\
         <a class=\"card\" href=\"/operator/inbox?state=orphaned\"><b>{orphaned}</b>orphaned callbacks</a></div>",
        oldest.map(|o| format!(" (oldest {})", html::age(now, o))).unwrap_or_default()
    ));
    body.push_str(&format!("<h2>Last {CHART_MINUTES} minutes</h2>"));
    body.push_str(&html::chart(&activity, now, CHART_MINUTES));
    body.push_str(&format!(
        "<h2 id=\"uncertain\">Needs you: {} uncertain</h2><p class=\"muted\">The effect target never confirmed \
         these. Check the target, then say how each really ended.</p>",
        uncertain.len()
    ));
    if uncertain.is_empty() {
        body.push_str("<p class=\"ok\">Nothing is waiting for an operator.</p>");
    } else {
        body.push_str("<table><tr><th>Operation</th><th>Tenant</th><th>Thread</th><th>Last error</th><th>Resolve</th></tr>");
        for op in &uncertain {
            body.push_str(&format!(
                "<tr><td><a href=\"/operator/operations/{}\"><code>{}</code></a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                html::enc(&op.id),
                html::esc(&op.id),
                html::esc(&op.tenant),
                html::esc(&op.thread_id),
                html::esc(op.last_error.as_deref().unwrap_or("")),
                html::resolve_form(op)
            ));
        }
        body.push_str("</table>");
    }
    Ok(Html(html::page("Overview", &body)).into_response())
}

/// Durations as people type them: 90s, 15m, 2h, 3d.
fn parse_age(text: &str) -> Option<i64> {
    let text = text.trim();
    let (n, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit())?);
    let n: i64 = n.parse().ok()?;
    let ms = match unit {
        "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return None,
    };
    n.checked_mul(ms)
}

async fn operations(
    _: Operator,
    State(state): State<AppState>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    let now = now_ms();
    let get = |k: &str| q.get(k).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
    let mut problems = Vec::new();
    let mut age = |k: &str| {
        get(k).and_then(|v| {
            let parsed = parse_age(&v);
            if parsed.is_none() {
                problems.push(format!("`{k}` must look like 90s, 15m, 2h or 3d"));
            }
            parsed
        })
    };
    let (older, newer) = (age("older_than"), age("newer_than"));
    if get("state").is_some_and(|s| s.parse::<crate::domain::state::State>().is_err()) {
        problems.push("`state` is not a state approvald has".to_string());
    }
    let filter = OperatorFilter {
        tenant: get("tenant"),
        state: get("state"),
        thread_id: get("thread"),
        recipient: get("recipient"),
        created_before: older.map(|o| now - o),
        created_after: newer.map(|n| now - n),
        limit: 200,
    };
    let value = |k: &str| html::esc(&get(k).unwrap_or_default());
    let mut body = format!(
        "<form method=\"get\" class=\"inline\" id=\"filters\">\
         <input name=\"state\" placeholder=\"state\" value=\"{}\" aria-label=\"state\">\
         <input name=\"tenant\" placeholder=\"tenant\" value=\"{}\" aria-label=\"tenant\">\
         <input name=\"thread\" placeholder=\"thread id\" value=\"{}\" aria-label=\"thread\">\
         <input name=\"recipient\" placeholder=\"recipient\" value=\"{}\" aria-label=\"recipient\">\
         <input name=\"older_than\" placeholder=\"older than (15m)\" value=\"{}\" aria-label=\"older than\">\
         <input name=\"newer_than\" placeholder=\"newer than (2h)\" value=\"{}\" aria-label=\"newer than\">\
         <button>Filter</button></form>",
        value("state"),
        value("tenant"),
        value("thread"),
        value("recipient"),
        value("older_than"),
        value("newer_than")
    );
    if !problems.is_empty() {
        for p in &problems {
            body.push_str(&format!("<p class=\"err\">{}</p>", html::esc(p)));
        }
        return Ok((StatusCode::BAD_REQUEST, Html(html::page("Operations", &body))).into_response());
    }
    let ops = state.engine.store().operator_operations(&filter).await?;
    body.push_str(&format!("<p class=\"muted\">{} shown (newest first, at most 200).</p>", ops.len()));
    body.push_str(&html::operations_table(&ops, now));
    Ok(Html(html::page("Operations", &body)).into_response())
}

async fn operation(
    _: Operator,
    State(state): State<AppState>,
    crate::api::IdPath(id): crate::api::IdPath,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    let store = state.engine.store();
    let Some(op) = store.get_operation(None, &id).await? else {
        let body = "<p class=\"err\">No working operation has that id (it may have been archived; \
                    GET /v1/operations/{id} still returns archived ones).</p>";
        return Ok((StatusCode::NOT_FOUND, Html(html::page("Operation not found", body))).into_response());
    };
    let transitions = store.transitions(&op.id).await?;
    let deliveries = store.deliveries(&op.id).await?;
    let calls = store.pushary_calls(&op.id).await?;
    let inbox = match &op.decision_id {
        // One inbox row per (tenant, decision); replays count as its duplicates.
        Some(d) => store.inbox_by_correlation(&op.tenant, d).await?.into_iter().collect(),
        None => Vec::new(),
    };
    let mut body = String::new();
    if q.contains_key("resolved") {
        body.push_str("<p class=\"ok\" id=\"flash\">Resolved. The outcome is being delivered.</p>");
    }
    let field = |k: &str, v: &str| format!("<tr><th>{k}</th><td>{}</td></tr>", html::esc(v));
    body.push_str("<table id=\"summary\">");
    body.push_str(&format!("<tr><th>state</th><td>{}</td></tr>", html::state_badge(op.state.as_str())));
    for (k, v) in [
        ("id", op.id.as_str()),
        ("tenant", &op.tenant),
        ("thread", &op.thread_id),
        ("interrupt", &op.interrupt_id),
        ("recipient", &op.spec.external_id),
        ("effect", &op.effect),
        ("decision id", op.decision_id.as_deref().unwrap_or("—")),
        ("answer", op.answer.as_deref().unwrap_or("—")),
        ("permit", op.permit_id.as_deref().unwrap_or("—")),
        ("outcome", op.outcome_status.as_deref().unwrap_or("—")),
        ("delivery", op.delivery.as_deref().unwrap_or("—")),
        ("receipt", op.receipt.as_deref().unwrap_or("—")),
        ("last error", op.last_error.as_deref().unwrap_or("—")),
    ] {
        body.push_str(&field(k, v));
    }
    body.push_str(&field("deadline", &crate::clock::rfc3339(op.deadline)));
    body.push_str("</table>");
    if op.state == crate::domain::state::State::Uncertain {
        body.push_str("<h2>Resolve</h2>");
        body.push_str(&html::resolve_form(&op));
    }
    body.push_str("<h2>Timeline</h2>");
    body.push_str(&html::timeline(&transitions, &inbox, &calls, &deliveries));
    Ok(Html(html::page(&format!("Operation {}", op.id), &body)).into_response())
}

async fn resolve(
    _: Operator,
    State(state): State<AppState>,
    headers: HeaderMap,
    crate::api::IdPath(id): crate::api::IdPath,
    body: Body,
) -> Result<Response, ApiError> {
    if !same_origin(&headers) {
        return Ok((
            StatusCode::FORBIDDEN,
            Html(html::page("Refused", "<p class=\"err\">Cross-site form refused.</p>")),
        )
            .into_response());
    }
    let fields = form(&read_body(body, 16 * 1024).await?);
    let get = |k: &str| fields.get(k).map(|v| v.trim().to_string()).unwrap_or_default();
    let (outcome, note, by) = (get("outcome"), get("note"), get("by"));
    let problem = if by.is_empty() || by.len() > 128 {
        Some("`by` must name you (1-128 characters)".to_string())
    } else if note.len() > 2000 {
        Some("`note` must be at most 2000 characters".to_string())
    } else {
        match state.engine.resolve(None, &id, &outcome, &note, &format!("{by} (operator page)")).await {
            Ok(op) => {
                tracing::info!(operation_id = %op.id, thread_id = %op.thread_id, outcome, by, "resolved on the operator page");
                return Ok(Redirect::to(&format!("/operator/operations/{}?resolved=1", html::enc(&op.id)))
                    .into_response());
            }
            Err(crate::worker::ResolveError::Store(e)) => return Err(e.into()),
            Err(e) => Some(e.to_string()),
        }
    };
    let body = format!(
        "<p class=\"err\">{}</p><p><a href=\"/operator/operations/{}\">Back to the operation</a></p>",
        html::esc(&problem.unwrap_or_default()),
        html::enc(&id)
    );
    Ok((StatusCode::UNPROCESSABLE_ENTITY, Html(html::page("Not resolved", &body))).into_response())
}

async fn inbox(
    _: Operator,
    State(state): State<AppState>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    let filter = q.get("state").map(|s| s.trim()).filter(|s| !s.is_empty());
    let entries = state.engine.store().list_inbox(filter, 200).await?;
    let mut body = String::from("<p>");
    for s in ["new", "processed", "ignored", "orphaned"] {
        body.push_str(&format!("<a href=\"/operator/inbox?state={s}\">{}</a> ", html::state_badge(s)));
    }
    body.push_str(
        "<a href=\"/operator/inbox\">all</a></p><p class=\"muted\">Orphaned callbacks matched no operation in \
         time; they stay here, and go back to work if their decision id turns up.</p>",
    );
    body.push_str(&html::inbox_table(&entries, now_ms()));
    Ok(Html(html::page("Inbox", &body)).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_parse_with_a_unit_and_nothing_else() {
        assert_eq!(parse_age("90s"), Some(90_000));
        assert_eq!(parse_age("15m"), Some(900_000));
        assert_eq!(parse_age("2h"), Some(7_200_000));
        assert_eq!(parse_age("3d"), Some(259_200_000));
        for bad in ["", "15", "m", "1w", "-5m", "5 m", "99999999999999999999d"] {
            assert_eq!(parse_age(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_session_cookie_is_a_mac_under_the_token_not_the_token() {
        let mac = session_mac("operator-token-0123456789", 1000);
        assert_eq!(mac.len(), 64);
        assert!(!mac.contains("operator-token"));
        assert_ne!(mac, session_mac("operator-token-0123456789", 1001));
        assert_ne!(mac, session_mac("another-token-0123456789", 1000));
    }

    #[test]
    fn cross_site_posts_are_told_apart() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("127.0.0.1:8080"));
        assert!(same_origin(&h));
        h.insert(header::ORIGIN, HeaderValue::from_static("http://127.0.0.1:8080"));
        assert!(same_origin(&h));
        h.insert(header::ORIGIN, HeaderValue::from_static("https://evil.example"));
        assert!(!same_origin(&h));
    }
}

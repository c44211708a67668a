//! The HTTP surface: the operations API (bearer token), the Pushary
//! callback receiver (signature), and health endpoints.

mod callbacks;
mod operations;
mod operator;

pub use operator::inbox_view;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use serde_json::json;

use crate::app::Role;
use crate::config::Config;
use crate::error::ApiError;
use crate::secret::Secret;
use crate::worker::Engine;

pub use crate::config::DEFAULT_TENANT;

/// Per tenant: when its stored secrets were read, and the effective set.
pub type SecretCache = std::collections::HashMap<String, (std::time::Instant, Arc<[Secret]>)>;

/// What every handler reads. axum clones the state for each request,
/// several times over (router, middleware, handler), so it is one `Arc`:
/// a clone is one atomic increment and its drop one decrement, where the
/// struct's seven `Arc`s and channel sender cost eight of each
/// (`perf`: their drops alone were 1.4% of approvald's CPU in ingest).
#[derive(Clone)]
pub struct AppState(Arc<Shared>);

impl AppState {
    pub fn new(shared: Shared) -> Self {
        Self(Arc::new(shared))
    }
}

impl std::ops::Deref for AppState {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// The parts of [`AppState`], built once by `app.rs` and shared by every
/// request.
pub struct Shared {
    pub config: Arc<Config>,
    pub engine: Arc<Engine>,
    /// Every API token with the tenant it belongs to.
    pub tokens: Arc<Vec<(Secret, String)>>,
    /// Each tenant's webhook secrets.
    pub webhook_secrets: Arc<std::collections::HashMap<String, Vec<Secret>>>,
    /// Secrets rotated in through the store, re-read every few seconds.
    pub secret_cache: Arc<std::sync::Mutex<SecretCache>>,
    /// Callbacks in progress; beyond `server.max_concurrent_callbacks`, 503.
    pub callback_slots: Arc<tokio::sync::Semaphore>,
    /// Group-commits verified callbacks to the inbox.
    pub inbox: crate::store::InboxWriter,
}

pub fn router(state: AppState, role: Role) -> Router {
    let mut router = Router::new();
    if matches!(role, Role::All | Role::Api) {
        router = router
            .route("/v1/operations", post(operations::enqueue).get(operations::list))
            .route("/v1/operations/{id}", get(operations::show).delete(operations::cancel))
            .route("/v1/operations/{id}/resolve", post(operator::resolve))
            .route("/v1/inbox", get(operator::inbox_list))
            .route("/v1/inbox/{id}", get(operator::inbox_show))
            .merge(crate::operator_ui::routes());
    }
    if matches!(role, Role::All | Role::Receiver) {
        router = router
            .route("/v1/callbacks/pushary", post(callbacks::receive_default))
            .route("/v1/callbacks/pushary/{tenant}", post(callbacks::receive_tenant));
    }
    router
        .route("/healthz", get(|| async { axum::Json(json!({"status": "ok"})) }))
        .route("/readyz", get(ready))
        .route("/openapi.json", get(openapi))
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::NotFound { detail: "no such route".into() } })
        .method_not_allowed_fallback(|| async {
            (
                StatusCode::METHOD_NOT_ALLOWED,
                axum::Json(
                    json!({"code": "method_not_allowed", "detail": "this route does not take that method"}),
                ),
            )
        })
        .layer(axum::middleware::from_fn_with_state(state.clone(), guard))
        .with_state(state)
}

/// Bounds every request: total header size, and the time to receive and
/// answer it (slow clients cannot hold connections forever).
async fn guard(
    axum::extract::State(state): axum::extract::State<AppState>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let header_bytes: usize = req.headers().iter().map(|(k, v)| k.as_str().len() + v.len() + 4).sum();
    if header_bytes > state.config.server.max_header_bytes {
        return ApiError::HeadersTooLarge.into_response();
    }
    let limit = Duration::from_secs(state.config.server.request_timeout_secs);
    match tokio::time::timeout(limit, next.run(req)).await {
        Ok(resp) => resp,
        Err(_) => ApiError::Timeout.into_response(),
    }
}

/// The API description, as checked in (tests hold it to the code).
pub const OPENAPI: &str = include_str!("../../docs/openapi.json");

async fn openapi() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI)
}

/// Prometheus' text format. Counters are this process's; the store's
/// gauges are read now. A store that cannot be read leaves its gauges out
/// (and says so in the log) rather than failing the whole scrape.
async fn metrics(axum::extract::State(state): axum::extract::State<AppState>) -> impl IntoResponse {
    let store = state.engine.store();
    let mut gauges = crate::metrics::StoreGauges {
        sqlite_writer: store.sqlite_writer_busy(),
        ..crate::metrics::StoreGauges::default()
    };
    match (store.operation_counts().await, store.inbox_depth().await) {
        (Ok(ops), Ok((waiting, orphaned, oldest))) => {
            gauges.operations_by_state = ops;
            gauges.inbox_by_state = vec![("new".into(), waiting), ("orphaned".into(), orphaned)];
            let age_ms = oldest.map_or(0, |o| (crate::clock::now_ms() - o).max(0));
            gauges.oldest_new_age = Duration::from_millis(u64::try_from(age_ms).unwrap_or(0));
        }
        (Err(e), _) | (_, Err(e)) => tracing::warn!(error = %e, "metrics: cannot read the store's gauges"),
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        state.engine.metrics().render(&gauges),
    )
}

async fn ready(axum::extract::State(state): axum::extract::State<AppState>) -> impl IntoResponse {
    let store = state.engine.store();
    let unavailable = || {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(
                json!({"status": "not_ready", "code": "store_unavailable", "detail": "the store cannot be reached"}),
            ),
        )
    };
    if store.ping().await.is_err() {
        return unavailable();
    }
    match store.migration_status().await {
        Ok((Some(applied), latest)) if applied >= latest => {
            (StatusCode::OK, axum::Json(json!({"status": "ready", "schema": applied})))
        }
        Ok((applied, latest)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "not_ready", "code": "migrations_pending",
                               "detail": format!("schema at {}, this binary needs {latest}; run `approvald migrate`",
                                                 applied.map_or("none".to_string(), |a| a.to_string()))})),
        ),
        Err(_) => unavailable(),
    }
}

/// One path segment (an id, a tenant) as a string. A segment that is not
/// UTF-8 or holds a NUL names nothing approvald stores: 404 in our error
/// shape, instead of axum's plain-text 400 (or PostgreSQL refusing the NUL,
/// which would read as the store being down).
pub struct IdPath(pub String);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for IdPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Path::<String>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(id)) if !id.contains('\0') => Ok(Self(id)),
            _ => Err(ApiError::NotFound { detail: "no such resource".into() }),
        }
    }
}

/// Checks `Authorization: Bearer <token>` against the configured tokens in
/// constant time per token.
pub(crate) fn authorize<'s>(state: &'s AppState, headers: &HeaderMap) -> Result<&'s str, ApiError> {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or(ApiError::Unauthorized { detail: "send Authorization: Bearer <api token>" })?;
    // Every token is compared, so timing does not reveal which one matched.
    let mut tenant = None;
    for (token, t) in state.tokens.iter() {
        if constant_time_eq(token.expose().as_bytes(), given.as_bytes()) {
            tenant = Some(t.as_str());
        }
    }
    tenant.ok_or(ApiError::Unauthorized { detail: "the api token is not valid" })
}

pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Reads a body up to `limit` bytes; larger is a 413 with our error shape.
pub(crate) async fn read_body(body: Body, limit: usize) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        let too_large =
            std::error::Error::source(&e).is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
        if too_large {
            ApiError::PayloadTooLarge { detail: format!("the body must be at most {limit} bytes") }
        } else {
            ApiError::bad_request("unreadable_body", "the request body could not be read")
        }
    })
}

pub(crate) fn require_json(headers: &HeaderMap) -> Result<(), ApiError> {
    let ct = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let essence = ct.split(';').next().unwrap_or("").trim();
    if essence.eq_ignore_ascii_case("application/json") {
        Ok(())
    } else {
        Err(ApiError::UnsupportedMediaType { detail: "send Content-Type: application/json".into() })
    }
}

//! Pushary: the API key works, and the webhook secrets approvald accepts
//! include the one Pushary signs with now.

use super::*;

/// `GET /webhook-secret` with the tenant's key: authenticated, cheap and
/// without side effects. Returns the check and Pushary's current secret.
pub(super) async fn check_pushary(config: &Config, tenant: &Tenant) -> (Check, Option<Secret>) {
    let name = format!("pushary ({})", tenant.name);
    let base = redact_url(&config.pushary.base_url);
    let key = api_key_key(&tenant.name);
    let key_fix = format!(
        "set `{key}` (or {}, or `{key}_file`) to this account's server key, pk_<id>.<secret>{}",
        env_var(&key),
        env_note(&env_var(&key))
    );
    let base_fix = format!(
        "check `pushary.base_url` (or {}; the real service is https://pushary.com/api/v1/server) \
         and that this host can reach it (proxy, firewall){}",
        env_var("pushary.base_url"),
        env_note(&env_var("pushary.base_url"))
    );
    let timeout = config.pushary_timeout();
    let client = match PusharyClient::new(&config.pushary.base_url, tenant.api_key.clone(), timeout) {
        Ok(c) => c,
        Err(e) => {
            return (
                Check::new(name, Status::Fail, format!("cannot build a client: {e}"), Some(key_fix)),
                None,
            );
        }
    };
    let started = Instant::now();
    let result = client.webhook_secret().await;
    let ms = started.elapsed().as_millis();
    match result {
        Ok(secret) => {
            let plain_http = url::Url::parse(&config.pushary.base_url)
                .is_ok_and(|u| u.scheme() == "http" && !u.host().is_some_and(|h| is_local(&h)));
            let finding = format!("{base}: reachable, API key accepted (GET /webhook-secret, {ms} ms)");
            let check = if plain_http {
                Check::new(
                    name,
                    Status::Warn,
                    format!("{finding}; but plain http to a remote host sends the API key in clear"),
                    Some(format!("use an https `pushary.base_url` (or {})", env_var("pushary.base_url"))),
                )
            } else {
                Check::ok(name, finding)
            };
            (check, Some(secret))
        }
        Err(PusharyError::Transport(e)) => (
            Check::new(
                name,
                Status::Fail,
                format!("{base}: unreachable ({e}; timeout {} s)", timeout.as_secs()),
                Some(base_fix),
            ),
            None,
        ),
        Err(PusharyError::Status { status: status @ (401 | 403), message, .. }) => (
            Check::new(
                name,
                Status::Fail,
                format!("{base}: bad API key: Pushary answered {status} ({})", clip(&message, 120)),
                Some(key_fix),
            ),
            None,
        ),
        Err(PusharyError::Status { status: 404, .. }) => (
            Check::new(
                name,
                Status::Fail,
                format!("{base}: answered 404 for /webhook-secret: not Pushary's server API"),
                Some(base_fix),
            ),
            None,
        ),
        Err(PusharyError::Status { status, message, .. }) => {
            let what =
                if status >= 500 || status == 429 { "Pushary is failing right now" } else { "refused" };
            (
                Check::new(
                    name,
                    Status::Fail,
                    format!("{base}: {what}: HTTP {status} ({})", clip(&message, 120)),
                    Some(if status >= 500 || status == 429 {
                        "try again later; if it persists, check Pushary's status".to_string()
                    } else {
                        base_fix
                    }),
                ),
                None,
            )
        }
        Err(PusharyError::Decode(e)) => (
            Check::new(
                name,
                Status::Fail,
                format!("{base}: answered 2xx but not as Pushary does ({e})"),
                Some(base_fix),
            ),
            None,
        ),
    }
}

// ---- webhook secrets -------------------------------------------------------------------------------

/// First 4 hex digits of the SHA-256: enough to tell secrets apart, nothing
/// about their value.
pub fn fingerprint(secret: &str) -> String {
    format!("sha256:{}", &hex::encode(Sha256::digest(secret.as_bytes()))[..4])
}

/// Pushary's webhook secret is used as is (its UTF-8 bytes) as the HMAC key,
/// and the protocol gives it no other format. What can be told locally:
/// whitespace or control characters (a pasted newline or quote) or an API
/// key in its place can never match; a value without the `whsec_` prefix
/// every Pushary-issued secret seen so far has is suspicious only.
pub(super) fn secret_shape(value: &str, api_key: &str) -> Option<(Status, &'static str)> {
    if value.chars().any(|c| c.is_whitespace() || c.is_control()) {
        Some((Status::Fail, "contains whitespace or control characters, so it can never match"))
    } else if value == api_key || value.starts_with("pk_") {
        Some((Status::Fail, "is a Pushary API key, not the webhook secret"))
    } else if !value.starts_with("whsec_") {
        Some((Status::Warn, "does not start with `whsec_` as Pushary's webhook secrets do"))
    } else {
        None
    }
}

/// A row of `webhook_secrets`: the secret and when it stops verifying.
type StoredSecret = (String, Option<i64>);

pub(super) fn check_webhook_secrets(
    tenant: &Tenant,
    stored: Option<Result<Vec<StoredSecret>, crate::store::StoreError>>,
    pushary_current: Option<&Secret>,
) -> Check {
    let name = format!("webhook secret ({})", tenant.name);
    let key = secrets_key(&tenant.name);
    let var = env_var(&key);
    let set_fix = format!(
        "set `{key}` (or {var}, or `{key}_file`) to the exact secret Pushary's GET /webhook-secret returns \
         for this API key{}",
        env_note(&var)
    );
    let mut status = Status::Ok;
    let mut findings = Vec::new();
    let mut fix = None;
    for (i, s) in tenant.webhook_secrets.iter().enumerate() {
        if let Some((st, problem)) = secret_shape(s.expose(), tenant.api_key.expose()) {
            findings.push(format!("`{key}[{i}]` {problem}"));
            if st == Status::Fail || status == Status::Ok {
                fix = Some(set_fix.clone());
            }
            status = worst(status, st);
        }
    }

    // What the receiver accepts now, as `api::callbacks` computes it: the
    // configured secrets less those a rotation retired, plus those rotated
    // in through the store and still within their window.
    let now = crate::clock::now_ms();
    let open = |until: &Option<i64>| until.is_none_or(|u| u > now);
    let (rows, store_note) = match stored {
        Some(Ok(rows)) => (rows, None),
        Some(Err(e)) => (Vec::new(), Some(format!("rotated secrets unreadable ({e})"))),
        None => (
            Vec::new(),
            Some("rotated secrets in the store not checked (store not open or not migrated)".to_string()),
        ),
    };
    let mut accepted: Vec<&str> = tenant
        .webhook_secrets
        .iter()
        .map(Secret::expose)
        .filter(|c| !rows.iter().any(|(s, until)| s == c && !open(until)))
        .collect();
    let retired_configured = tenant.webhook_secrets.len() - accepted.len();
    let valid_rotated: Vec<&str> = rows.iter().filter(|(_, u)| open(u)).map(|(s, _)| s.as_str()).collect();
    for s in &valid_rotated {
        if !accepted.contains(s) {
            accepted.push(s);
        }
    }
    let mut summary = format!("{} configured", tenant.webhook_secrets.len());
    match &store_note {
        None => {
            let current = rows.iter().filter(|(_, u)| u.is_none()).count();
            let retiring: Vec<i64> = rows.iter().filter_map(|(_, u)| u.filter(|u| *u > now)).collect();
            let expired = rows.len() - current - retiring.len();
            summary.push_str(&format!(
                "; in the store (`approvald secret rotate`): {} valid ({current} current, {} retiring{}), \
                 {expired} expired",
                valid_rotated.len(),
                retiring.len(),
                retiring
                    .iter()
                    .max()
                    .map(|u| format!(", the last until {}", crate::clock::rfc3339(*u)))
                    .unwrap_or_default()
            ));
        }
        Some(note) => summary.push_str(&format!("; {note}")),
    }
    if retired_configured > 0 {
        summary.push_str(&format!(", {retired_configured} configured one(s) retired by a rotation"));
    }
    let prints: Vec<String> = accepted.iter().map(|s| fingerprint(s)).collect();

    if accepted.is_empty() {
        findings.push("no webhook secret: every callback would be rejected (401)".into());
        status = Status::Fail;
        fix = Some(set_fix.clone());
    } else if let Some(current) = pushary_current {
        if accepted.contains(&current.expose()) {
            findings
                .push(format!("Pushary's current secret ({}) is accepted", fingerprint(current.expose())));
        } else {
            findings.push(format!(
                "none of the accepted secrets ({}) is the one Pushary signs callbacks with now ({}): \
                 every callback would be rejected",
                prints.join(", "),
                fingerprint(current.expose())
            ));
            status = Status::Fail;
            fix = Some(format!(
                "{set_fix}, or run `approvald secret rotate --tenant {}` to get and store a new one",
                tenant.name
            ));
        }
    } else {
        findings.push(format!(
            "accepted: {}; not compared with Pushary's (it did not answer)",
            prints.join(", ")
        ));
    }
    findings.push(summary);
    Check::new(name, status, findings.join("; "), fix)
}

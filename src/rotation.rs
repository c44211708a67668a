//! `approvald secret rotate`: a new Pushary webhook secret, with the old
//! ones still accepted for an overlap window, shared by every replica
//! through the store.

use std::time::Duration;

use anyhow::Context as _;

use crate::clock::now_ms;
use crate::config::Config;
use crate::pushary::PusharyClient;
use crate::store::Store;

/// Asks Pushary for a new webhook secret and stores it; every secret known
/// before (configured or rotated in earlier) keeps verifying until the
/// returned time (Unix ms). The secret itself is never printed or logged.
pub async fn rotate_webhook_secret(config: &Config, tenant: &str, overlap: Duration) -> anyhow::Result<i64> {
    let t = config
        .tenants()
        .into_iter()
        .find(|t| t.name == tenant)
        .with_context(|| format!("--tenant: no tenant `{tenant}` is configured"))?;
    let store = Store::connect(&config.store).await.context("opening the store")?;
    store.migrate().await.context("migrating the store")?;
    let client = PusharyClient::new(&config.pushary.base_url, t.api_key.clone(), config.pushary_timeout())
        .map_err(|e| anyhow::anyhow!("pushary client: {e}"))?;
    let new =
        client.rotate_webhook_secret().await.map_err(|e| anyhow::anyhow!("rotating at Pushary: {e}"))?;
    let mut known: Vec<String> = t.webhook_secrets.iter().map(|s| s.expose().to_string()).collect();
    known.extend(store.webhook_secrets(tenant).await?.into_iter().map(|(s, _)| s));
    let now = now_ms();
    let until = now.saturating_add(i64::try_from(overlap.as_millis()).unwrap_or(i64::MAX / 2));
    // Pushary already signs with the new secret; if storing fails, callbacks
    // fail verification (401) and Pushary retries them until it is stored.
    store.rotate_webhook_secret(tenant, new.expose(), &known, now, until).await?;
    store.close().await;
    Ok(until)
}

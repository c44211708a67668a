//! Secret rotation: Pushary webhook secrets (old and new accepted during
//! the overlap, on every replica through the store) and effect-target
//! signing secrets (old and new signatures both sent during the window).

use std::time::Instant;

use serde_json::json;

use crate::daemon::Daemon;
use crate::harness::{Options, TestApp, WAIT, confirm};

async fn post(d: &Daemon, secret: &str, decision: &str) -> u16 {
    let body = serde_json::to_vec(&json!({"correlationId": decision, "answer": "yes"})).expect("json");
    let sig = approvald::pushary::signature::sign(secret, &body);
    d.http
        .post(format!("{}/v1/callbacks/pushary", d.base))
        .header("X-Pushary-Signature", sig)
        .body(body)
        .send()
        .await
        .expect("send")
        .status()
        .as_u16()
}

/// Posts until the status is `want` (the receiver re-reads rotated secrets
/// every few seconds), bounded.
async fn until_status(d: &Daemon, secret: &str, decision: &str, want: u16) {
    let start = Instant::now();
    loop {
        let got = post(d, secret, decision).await;
        if got == want {
            return;
        }
        assert!(start.elapsed() < WAIT, "never answered {want} (last {got})");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

both_engines! {
async fn a_rotated_webhook_secret_verifies_and_the_old_one_only_during_the_overlap() {
    let mut d = Daemon::new("").await;
    d.start(None).await;
    let original = d.sandbox.webhook_secret();
    let out = d.cli(&["secret", "rotate", "--overlap-secs", "3600"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rotated = d.sandbox.webhook_secret();
    assert_ne!(rotated, original, "Pushary issued a new secret");
    let printed = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(!printed.contains(&rotated), "the secret is never printed");
    // Both verify during the overlap (unknown decisions are simply kept).
    until_status(&d, &rotated, "dec_new_1", 200).await;
    assert_eq!(post(&d, &original, "dec_old_1").await, 200);
    // Callbacks Pushary signs from now on complete the loop.
    let id = d.enqueue(&confirm("rotated")).await;
    let op = d.wait_op(&id, "pending", |o| o["state"] == "pending").await;
    let decision = op["decisionId"].as_str().expect("decision").to_string();
    d.sandbox.answer(&decision, "yes", approvald::sandbox::CallbackMode::Send).await.expect("answer");
    d.wait_op(&id, "succeeded", |o| o["state"] == "succeeded").await;
    // A second rotation with no overlap retires both earlier secrets at once.
    let out = d.cli(&["secret", "rotate", "--overlap-secs", "0"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let newest = d.sandbox.webhook_secret();
    until_status(&d, &original, "dec_old_2", 401).await;
    until_status(&d, &rotated, "dec_old_3", 401).await;
    until_status(&d, &newest, "dec_new_2", 200).await;
    // Unknown tenants are refused with the flag named.
    let out = d.cli(&["secret", "rotate", "--tenant", "nobody"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--tenant"));
}
}

fn whsec() -> String {
    use base64::Engine as _;
    format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode(rand::random::<[u8; 24]>()))
}

both_engines! {
async fn an_effect_secret_rotation_signs_with_both_until_the_window_closes() {
    // The application (the sandbox's target) still knows only the previous
    // secret; approvald signs with the new one and, in the window, the old.
    for (until, verified) in [("2999-01-01T00:00:00Z", true), ("2000-01-01T00:00:00Z", false)] {
        let app = TestApp::spawn_with(Options {
            effect_secret_override: Some(whsec()),
            extra_toml: format!("previous_secret = \"__EFFECT_SECRET__\"\nprevious_secret_until = \"{until}\""),
            ..Options::default()
        })
        .await;
        let id = app.enqueue_ok(&confirm("effect-rotation")).await;
        let decision = app.decision_of(&id).await;
        app.answer(&decision, "yes").await;
        let op = app.wait_state(&id, &["succeeded", "failed"]).await;
        let seen = app.sandbox.effect_deliveries();
        let header = seen[0].headers.get("webhook-signature").cloned().unwrap_or_default();
        if verified {
            assert_eq!(op["state"], "succeeded", "{op:#}");
            assert_eq!(header.split(' ').count(), 2, "two signatures during the window: {header}");
        } else {
            assert_eq!(op["state"], "failed", "after the window the old secret no longer signs: {op:#}");
            assert_eq!(header.split(' ').count(), 1);
        }
    }
}
}

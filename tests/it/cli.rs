//! The command line, run as a user would run it.

use std::process::Command;

fn approvald() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_approvald"));
    c.env_remove("APPROVALD_CONFIG");
    c
}

#[test]
fn help_explains_each_command() {
    let out = approvald().arg("--help").output().expect("runs");
    let text = String::from_utf8_lossy(&out.stdout);
    for cmd in ["serve", "dev", "migrate", "ops"] {
        assert!(text.contains(cmd), "{cmd} missing from --help:\n{text}");
    }
}

#[test]
fn a_bad_config_names_the_key_and_never_echoes_a_secret() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = approvald()
        .arg("migrate")
        .env("APPROVALD_PUSHARY__API_KEY", "pk_nodot_supersecret")
        .env("APPROVALD_STORE__URL", format!("sqlite://{}", dir.path().join("x.db").display()))
        .output()
        .expect("runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("pushary.api_key"), "{err}");
    assert!(!err.contains("supersecret"), "{err}");
}

#[test]
fn migrate_twice_then_ops_list_and_show() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("cli.db");
    let run = |args: &[&str]| {
        approvald()
            .args(args)
            .env("APPROVALD_PUSHARY__API_KEY", "pk_test.secret")
            .env("APPROVALD_STORE__URL", format!("sqlite://{}", db.display()))
            .output()
            .expect("runs")
    };
    for _ in 0..2 {
        let out = run(&["migrate"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains("schema is at version 8"));
    }
    let out = run(&["ops", "list"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("0 operation(s)"));
    let out = run(&["ops", "show", "op_missing"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no operation `op_missing`"));
    let out = run(&["ops", "list", "--state", "bogus"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--state"));
}

#[tokio::test]
async fn the_sandbox_runs_alone_with_the_credentials_it_is_given() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let mut child = approvald()
        .args(["sandbox", "--listen", &format!("127.0.0.1:{port}")])
        .env("APPROVALD_SANDBOX_API_KEY", "pk_sandbox.given")
        .env("APPROVALD_SANDBOX_WEBHOOK_SECRET", "whsec_given")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("runs");
    let http = approvald::http::client_builder().build().expect("client");
    let start = std::time::Instant::now();
    let secret = loop {
        let got = http
            .get(format!("http://127.0.0.1:{port}/api/v1/server/webhook-secret"))
            .bearer_auth("pk_sandbox.given")
            .send()
            .await;
        if let Ok(r) = got {
            break r.json::<serde_json::Value>().await.expect("json")["secret"].clone();
        }
        assert!(start.elapsed() < crate::harness::WAIT, "the sandbox never answered");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(secret, "whsec_given");
}

//! The shared Pushary vectors: signatures and deterministic keys.

use serde_json::Value;

fn vectors() -> Value {
    serde_json::from_str(include_str!("../vectors/pushary.json")).expect("vectors parse")
}

#[test]
fn signature_verification_agrees_with_every_vector() {
    let v = vectors();
    let cases = v["signatures"].as_array().expect("signatures");
    assert!(cases.len() >= 10);
    for case in cases {
        let body = hex::decode(case["body_hex"].as_str().expect("hex")).expect("hex decodes");
        let secret = case["secret"].as_str().expect("secret");
        let sig = case["signature"].as_str().expect("signature");
        let valid = case["valid"].as_bool().expect("valid");
        assert_eq!(
            approvald::pushary::signature::verify([secret], &body, sig),
            valid,
            "vector {}",
            case["name"]
        );
        if valid {
            assert_eq!(approvald::pushary::signature::sign(secret, &body), sig, "vector {}", case["name"]);
        }
    }
}

#[test]
fn deterministic_keys_agree_with_every_vector() {
    let v = vectors();
    for case in v["deterministic_keys"].as_array().expect("keys") {
        let parts: Vec<&str> =
            case["parts"].as_array().expect("parts").iter().map(|p| p.as_str().expect("str")).collect();
        assert_eq!(
            approvald::domain::keys::deterministic_key(&parts),
            case["key"].as_str().expect("key"),
            "{parts:?}"
        );
    }
}

//! Standard Webhooks signatures (<https://www.standardwebhooks.com>) for
//! deliveries to effect targets: `v1,` + base64 HMAC-SHA256 of
//! `"{id}.{timestamp}.{body}"`, keyed with the base64 part of a `whsec_` secret.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// How far a timestamp may be from now before a receiver rejects it.
pub const TOLERANCE_SECS: i64 = 300;

/// Decodes a `whsec_<base64>` secret into its key bytes.
pub fn decode_secret(secret: &str) -> Result<Vec<u8>, String> {
    let b64 = secret.strip_prefix("whsec_").ok_or_else(|| "must start with `whsec_`".to_string())?;
    let key = STANDARD.decode(b64).map_err(|_| "the part after `whsec_` must be base64".to_string())?;
    if key.len() < 16 {
        return Err("the key must be at least 16 bytes (24 base64 characters)".to_string());
    }
    Ok(key)
}

/// One `v1,<base64>` signature.
pub fn sign(key: &[u8], msg_id: &str, timestamp: i64, body: &[u8]) -> String {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC accepts any key length");
    mac.update(msg_id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()))
}

/// The `webhook-signature` header: one signature per key, space separated.
pub fn signature_header(keys: &[Vec<u8>], msg_id: &str, timestamp: i64, body: &[u8]) -> String {
    keys.iter().map(|k| sign(k, msg_id, timestamp, body)).collect::<Vec<_>>().join(" ")
}

#[derive(Debug, PartialEq, Eq)]
pub enum VerifyError {
    Timestamp,
    Signature,
}

/// Verifies a delivery as a receiving application would: timestamp within
/// tolerance of `now`, and any listed `v1` signature matching (constant time).
pub fn verify(
    key: &[u8],
    msg_id: &str,
    timestamp: &str,
    signatures: &str,
    body: &[u8],
    now: i64,
) -> Result<(), VerifyError> {
    let ts: i64 = timestamp.parse().map_err(|_| VerifyError::Timestamp)?;
    if (now - ts).abs() > TOLERANCE_SECS {
        return Err(VerifyError::Timestamp);
    }
    let found = signatures.split(' ').filter_map(|s| s.strip_prefix("v1,")).any(|s| {
        STANDARD.decode(s).is_ok_and(|sig| {
            let mut mac = HmacSha256::new_from_slice(key).expect("HMAC accepts any key length");
            mac.update(msg_id.as_bytes());
            mac.update(b".");
            mac.update(timestamp.as_bytes());
            mac.update(b".");
            mac.update(body);
            mac.verify_slice(&sig).is_ok()
        })
    });
    if found { Ok(()) } else { Err(VerifyError::Signature) }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The example from the Standard Webhooks specification's reference tests.
    #[test]
    fn matches_the_specification_example() {
        let key = decode_secret("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let body = br#"{"test": 2432232314}"#;
        let sig = sign(&key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body);
        assert_eq!(sig, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
        assert!(verify(&key, "msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265330", &sig, body, 1614265330).is_ok());
        assert_eq!(
            verify(&key, "msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265330", &sig, b"{}", 1614265330),
            Err(VerifyError::Signature)
        );
        assert_eq!(
            verify(&key, "msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265330", &sig, body, 1614265330 + 301),
            Err(VerifyError::Timestamp)
        );
        let other = decode_secret("whsec_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA").unwrap();
        let both = signature_header(&[other, key.clone()], "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body);
        assert!(verify(&key, "msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265330", &both, body, 1614265330).is_ok());
    }
}

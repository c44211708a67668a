//! Pushary's callback signature: lowercase hex HMAC-SHA256 of the raw body,
//! keyed with the webhook secret's UTF-8 bytes. No timestamp is signed, so
//! replay protection is the inbox's dedup plus the operation state machine.

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// The header value Pushary sends for `body` under `secret`.
pub fn sign(secret: &str, body: &[u8]) -> String {
    let mut mac = HmacSha256::new_from_slice(secret.as_bytes()).expect("HMAC accepts any key length");
    mac.update(body);
    hex::encode(mac.finalize().into_bytes())
}

/// Checks `signature` against `body` for any of `secrets` (several during a
/// rotation window). The shape check (64 lowercase hex digits) depends only
/// on the public header; the digest comparison is constant time. An empty
/// signature or an empty secret never verifies.
pub fn verify<'a>(secrets: impl IntoIterator<Item = &'a str>, body: &[u8], signature: &str) -> bool {
    if signature.len() != 64 || !signature.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return false;
    }
    let Ok(expected) = hex::decode(signature) else {
        return false;
    };
    let mut ok = false;
    for secret in secrets {
        if secret.is_empty() {
            continue;
        }
        let mut mac = HmacSha256::new_from_slice(secret.as_bytes()).expect("HMAC accepts any key length");
        mac.update(body);
        // Every secret is tried, so timing does not reveal which one matched.
        ok |= mac.verify_slice(&expected).is_ok();
    }
    ok
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_rejections() {
        let sig = sign("whsec_a", b"{}");
        assert!(verify(["whsec_a"], b"{}", &sig));
        assert!(verify(["old", "whsec_a"], b"{}", &sig));
        assert!(!verify(["whsec_b"], b"{}", &sig));
        assert!(!verify(["whsec_a"], b"{ }", &sig));
        assert!(!verify(["whsec_a"], b"{}", &sig.to_uppercase()));
        assert!(!verify(["whsec_a"], b"{}", ""));
        assert!(!verify([""], b"{}", &sign("", b"{}")));
        assert!(!verify(Vec::<&str>::new(), b"{}", &sig));
    }
}

//! Keeping secrets out of the report: redacted URLs, fingerprints, and a
//! scrub of every finding.

use super::*;

/// `url` with any password (user info or a `password`-like query
/// parameter) replaced by `***`. An unparseable URL is not shown at all.
pub fn redact_url(raw: &str) -> String {
    let Ok(mut u) = url::Url::parse(raw) else {
        return match raw.split_once(':') {
            Some((scheme, _)) if !scheme.is_empty() && scheme.chars().all(|c| c.is_ascii_alphanumeric()) => {
                format!("{scheme}:… (unparseable, not shown)")
            }
            _ => "(unparseable URL, not shown)".to_string(),
        };
    };
    if u.password().is_some() {
        let _ = u.set_password(Some("***"));
    }
    if u.query().is_some() {
        let sensitive = |k: &str| {
            let k = k.to_ascii_lowercase();
            ["password", "passwd", "secret", "token", "key"].iter().any(|s| k.contains(s))
        };
        let pairs: Vec<(String, String)> = u
            .query_pairs()
            .map(|(k, v)| {
                let v = if sensitive(&k) { "***".to_string() } else { v.into_owned() };
                (k.into_owned(), v)
            })
            .collect();
        u.query_pairs_mut().clear().extend_pairs(pairs);
    }
    u.to_string()
}

/// Every secret the configuration holds.
pub(super) fn config_secrets(config: &Config) -> Vec<String> {
    let mut out = Vec::new();
    for t in config.tenants() {
        out.push(t.api_key.expose().to_string());
        out.extend(t.tokens.iter().map(|s| s.expose().to_string()));
        out.extend(t.webhook_secrets.iter().map(|s| s.expose().to_string()));
        for e in t.effects.values() {
            out.extend(e.secret.iter().chain(&e.previous_secret).map(|s| s.expose().to_string()));
        }
    }
    out.extend(config.operator.token.iter().map(|s| s.expose().to_string()));
    for raw in [&config.store.url, &config.pushary.base_url, &config.server.public_url] {
        if let Ok(u) = url::Url::parse(raw)
            && let Some(p) = u.password()
        {
            out.push(p.to_string());
            if let Ok(decoded) = urlencoding_decode(p) {
                out.push(decoded);
            }
        }
    }
    out
}

pub(super) fn urlencoding_decode(s: &str) -> Result<String, std::string::FromUtf8Error> {
    let mut bytes = Vec::with_capacity(s.len());
    let raw = s.as_bytes();
    let mut i = 0;
    while i < raw.len() {
        if raw[i] == b'%'
            && let Some(hex) = raw.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok())
            && let Ok(b) = u8::from_str_radix(hex, 16)
        {
            bytes.push(b);
            i += 3;
            continue;
        }
        bytes.push(raw[i]);
        i += 1;
    }
    String::from_utf8(bytes)
}

/// Replaces every secret (and its trimmed form) in the findings by `***`.
/// Values shorter than 4 characters are left: they would mangle ordinary
/// words and say nothing.
pub(super) fn scrub(checks: &mut [Check], secrets: &[String]) {
    let mut values: Vec<&str> =
        secrets.iter().flat_map(|s| [s.as_str(), s.trim()]).filter(|s| s.chars().count() >= 4).collect();
    // Longest first, so a secret containing another is replaced whole.
    values.sort_by_key(|s| std::cmp::Reverse(s.len()));
    values.dedup();
    for c in checks {
        for text in std::iter::once(&mut c.finding).chain(c.fix.as_mut()) {
            for v in &values {
                if text.contains(v) {
                    *text = text.replace(v, "***");
                }
            }
        }
    }
}

pub(super) fn clip(s: &str, n: usize) -> String {
    let s = s.replace(['\n', '\r'], " ");
    if s.chars().count() <= n { s } else { format!("{}…", s.chars().take(n - 1).collect::<String>()) }
}

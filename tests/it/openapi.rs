//! The OpenAPI document (docs/openapi.json) against the running code.
//!
//! - `GET /openapi.json` serves exactly the checked-in document;
//! - the routes the code serves are the routes the document describes, and
//!   each documented route is really routed (no 404/405 fallback);
//! - real responses of every status class, from a real approvald and the
//!   Pushary sandbox, validate against the schema documented for their
//!   status (a small JSON Schema checker below: a field the code returns
//!   that the document does not describe, a missing required field, a wrong
//!   type or enum value, an undocumented status or content type all fail);
//! - what the code accepts in a request body, the document accepts.
//!
//! `.ci/schemathesis` fuzzes the same document against `approvald dev`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use reqwest::{Method, RequestBuilder};
use serde_json::{Value, json};

use crate::harness::{Options, TOKEN, TestApp, WAIT, confirm};

/// The routes `approvald::api::router` serves: keep in step with
/// `src/api/mod.rs` (`router`). The test below also reads the `.route(...)`
/// calls out of the router's source (`ROUTER_SOURCES`), so a route added
/// there without a line here, and in docs/openapi.json, fails.
const SERVED: &[(&str, &str)] = &[
    ("POST", "/v1/operations"),
    ("GET", "/v1/operations"),
    ("GET", "/v1/operations/{id}"),
    ("DELETE", "/v1/operations/{id}"),
    ("POST", "/v1/operations/{id}/resolve"),
    ("GET", "/v1/inbox"),
    ("GET", "/v1/inbox/{id}"),
    ("POST", "/v1/callbacks/pushary"),
    ("POST", "/v1/callbacks/pushary/{tenant}"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/openapi.json"),
    ("GET", "/metrics"),
];

/// Served, but deliberately not part of the API description: the operator
/// pages are HTML for a browser (src/operator_ui; this path and everything
/// under it).
const NOT_API: &[&str] = &["/operator"];

const HTTP_METHODS: &[&str] = &["get", "put", "post", "delete", "options", "head", "patch", "trace"];

fn document() -> Value {
    serde_json::from_str(approvald::api::OPENAPI).expect("docs/openapi.json is JSON")
}

fn documented_routes(doc: &Value) -> BTreeSet<(String, String)> {
    let mut out = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, _) in item.as_object().expect("path item") {
            if HTTP_METHODS.contains(&method.as_str()) {
                out.insert((method.to_uppercase(), path.clone()));
            }
        }
    }
    out
}

fn is_not_api(path: &str) -> bool {
    NOT_API.iter().any(|p| path == *p || path.starts_with(&format!("{p}/")))
}

/// Where the router (`approvald::api::router`) and the routers it merges
/// are built, relative to the crate root; missing ones are skipped.
const ROUTER_SOURCES: &[&str] = &["src/api", "src/operator_ui"];

/// `(METHOD, path)` of every route in the router's source files.
fn routes_in_router_source() -> BTreeSet<(String, String)> {
    fn walk(dir: &std::path::Path, out: &mut BTreeSet<(String, String)>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let src = std::fs::read_to_string(&path).expect("read a router source file");
                out.extend(routes_in_source(&src));
            }
        }
    }
    let mut out = BTreeSet::new();
    for dir in ROUTER_SOURCES {
        walk(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(dir), &mut out);
    }
    out
}

/// `(METHOD, path)` of every `.route("path", get(..).post(..))` call in `src`.
fn routes_in_source(src: &str) -> BTreeSet<(String, String)> {
    let mut out = BTreeSet::new();
    let mut rest = src;
    while let Some(at) = rest.find(".route(") {
        rest = &rest[at + ".route(".len()..];
        let Some(open) = rest.find('"') else { break };
        let Some(len) = rest[open + 1..].find('"') else { break };
        let path = rest[open + 1..open + 1 + len].to_string();
        // The call's arguments: up to the parenthesis that closes `.route(`.
        let mut depth = 1usize;
        let mut end = rest.len();
        for (i, c) in rest.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        end = i;
                        break;
                    }
                }
                _ => {}
            }
        }
        let args = &rest[..end];
        for method in HTTP_METHODS {
            let needle = format!("{method}(");
            let mut from = 0;
            while let Some(i) = args[from..].find(&needle) {
                let i = from + i;
                let before = args[..i].chars().next_back();
                if !before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                    out.insert((method.to_uppercase(), path.clone()));
                }
                from = i + needle.len();
            }
        }
        rest = &rest[end..];
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_served_document_is_the_checked_in_one_and_well_formed() {
    let app = TestApp::spawn().await;
    let resp = app.http.get(format!("{}/openapi.json", app.base)).send().await.expect("send");
    assert_eq!(resp.status().as_u16(), 200);
    let ct = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    assert_eq!(ct, "application/json");
    let served: Value = resp.json().await.expect("json");
    let doc = document();
    assert_eq!(served, doc, "GET /openapi.json is docs/openapi.json");

    // Checked in pretty-printed with 2-space indentation, ending in a newline.
    let text = approvald::api::OPENAPI;
    assert!(text.ends_with("}\n") && !text.contains('\t'), "pretty-printed, newline at the end");
    for (n, line) in text.lines().enumerate() {
        let indent = line.len() - line.trim_start_matches(' ').len();
        assert!(indent % 2 == 0 && !line.ends_with(' '), "line {}: {line:?}", n + 1);
    }

    assert!(doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.1.")), "OpenAPI 3.1");
    // Every reference resolves; operation ids are unique; every path
    // parameter is declared; every response is described and security
    // schemes exist.
    let contract = Contract::new();
    let mut refs = Vec::new();
    collect_refs(&doc, &mut refs);
    for r in &refs {
        assert!(contract.pointer(r).is_some(), "unresolved $ref {r}");
    }
    let mut ids = BTreeSet::new();
    let schemes = doc["components"]["securitySchemes"].as_object().expect("security schemes");
    for (path, item) in doc["paths"].as_object().expect("paths") {
        let mut declared: BTreeSet<String> = BTreeSet::new();
        let params = |v: &Value| -> Vec<String> {
            v["parameters"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|p| contract.resolve(p))
                        .filter(|p| p["in"] == "path")
                        .map(|p| p["name"].as_str().expect("name").to_string())
                        .collect()
                })
                .unwrap_or_default()
        };
        declared.extend(params(item));
        let wanted: BTreeSet<String> = path
            .split('/')
            .filter_map(|s| s.strip_prefix('{')?.strip_suffix('}'))
            .map(String::from)
            .collect();
        for (method, op) in item.as_object().expect("item") {
            if !HTTP_METHODS.contains(&method.as_str()) {
                continue;
            }
            let mut mine = declared.clone();
            mine.extend(params(op));
            assert_eq!(mine, wanted, "{method} {path}: path parameters");
            let id = op["operationId"].as_str().expect("operationId");
            assert!(ids.insert(id.to_string()), "operationId {id} twice");
            let security = op["security"].as_array().unwrap_or_else(|| panic!("{method} {path}: security"));
            for s in security {
                for name in s.as_object().expect("requirement").keys() {
                    assert!(schemes.contains_key(name), "{method} {path}: unknown security scheme {name}");
                }
            }
            let responses = op["responses"].as_object().expect("responses");
            assert!(!responses.is_empty(), "{method} {path}: responses");
            for (status, r) in responses {
                assert!(status.parse::<u16>().is_ok(), "{method} {path}: status {status}");
                assert!(
                    contract.resolve(r)["description"].is_string(),
                    "{method} {path} {status}: description"
                );
            }
        }
    }
}

fn collect_refs(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            if let Some(r) = m.get("$ref").and_then(Value::as_str) {
                out.push(r.to_string());
            }
            m.values().for_each(|v| collect_refs(v, out));
        }
        Value::Array(a) => a.iter().for_each(|v| collect_refs(v, out)),
        _ => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_served_route_is_documented_and_every_documented_route_is_served() {
    let served: BTreeSet<(String, String)> =
        SERVED.iter().map(|(m, p)| (m.to_string(), p.to_string())).collect();
    let doc = document();
    let documented = documented_routes(&doc);
    let only_documented: Vec<_> = documented.difference(&served).collect();
    let only_served: Vec<_> = served.difference(&documented).collect();
    assert!(
        only_documented.is_empty() && only_served.is_empty(),
        "documented but not in SERVED: {only_documented:?}; in SERVED but not documented: {only_served:?}"
    );
    // The list above against the router's source.
    let all_in_source = routes_in_router_source();
    let in_source: BTreeSet<(String, String)> =
        all_in_source.iter().filter(|(_, p)| !is_not_api(p)).cloned().collect();
    assert!(in_source.len() >= 10, "the route scan still reads the router: {all_in_source:?}");
    let missing: Vec<_> = in_source.difference(&served).collect();
    assert!(missing.is_empty(), "the router routes {missing:?} that SERVED and docs/openapi.json lack");
    let unrouted: Vec<_> = served.difference(&in_source).collect();
    assert!(unrouted.is_empty(), "SERVED lists {unrouted:?} that the router's source does not route");

    // Each documented route is really routed: a request to it (no token,
    // no body) is answered by its handler, not by the router's 404 or 405
    // fallback; a method it does not document is the 405 fallback.
    let app = TestApp::spawn().await;
    for (method, path) in &documented {
        let concrete = path.replace("{id}", "1").replace("{tenant}", "no-such-tenant");
        let m = Method::from_bytes(method.as_bytes()).expect("method");
        let resp = app.http.request(m, format!("{}{concrete}", app.base)).send().await.expect("send");
        let status = resp.status().as_u16();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        assert!(
            status != 405 && !(status == 404 && body["detail"] == "no such route"),
            "{method} {path} is documented but not routed: {status} {body}"
        );
        let item = doc["paths"][path.as_str()].as_object().expect("item");
        let unused = ["PUT", "PATCH", "POST", "DELETE"]
            .into_iter()
            .find(|m| !item.contains_key(&m.to_lowercase()))
            .expect("some method is not documented");
        let resp = app
            .http
            .request(
                Method::from_bytes(unused.as_bytes()).expect("method"),
                format!("{}{concrete}", app.base),
            )
            .send()
            .await
            .expect("send");
        assert_eq!(resp.status().as_u16(), 405, "{unused} {path} is served but not documented");
    }
    let resp = app.http.get(format!("{}/v1/no-such-route", app.base)).send().await.expect("send");
    assert_eq!(resp.status().as_u16(), 404);
}

/// The document, and the operations and statuses seen so far.
pub struct Contract {
    doc: Value,
    seen: Mutex<BTreeSet<(String, String, u16)>>,
}

impl Contract {
    fn new() -> Self {
        Contract { doc: document(), seen: Mutex::new(BTreeSet::new()) }
    }

    /// A local JSON pointer reference (`#/components/...`).
    fn pointer(&self, r: &str) -> Option<&Value> {
        let p = r.strip_prefix('#')?;
        let p = p.replace("~1", "/").replace("~0", "~");
        self.doc.pointer(&p)
    }

    /// Follows `$ref`s to the object they name.
    fn resolve<'a>(&'a self, mut v: &'a Value) -> &'a Value {
        for _ in 0..16 {
            match v.get("$ref").and_then(Value::as_str) {
                Some(r) => v = self.pointer(r).unwrap_or_else(|| panic!("unresolved $ref {r}")),
                None => return v,
            }
        }
        panic!("a $ref cycle")
    }

    fn operation(&self, method: &str, template: &str) -> &Value {
        let op = &self.doc["paths"][template][method.to_lowercase()];
        assert!(op.is_object(), "{method} {template} is not documented");
        op
    }

    /// The body the code accepted is valid against the documented request schema.
    fn check_request(&self, method: &str, template: &str, body: &Value) {
        let op = self.operation(method, template);
        let schema = &self.resolve(&op["requestBody"])["content"]["application/json"]["schema"];
        assert!(schema.is_object(), "{method} {template}: no application/json request body documented");
        let mut errors = Vec::new();
        self.validate(schema, body, "request", &mut errors);
        assert!(
            errors.is_empty(),
            "{method} {template}: the code accepted a body the document refuses:\n  {}\nbody: {body:#}",
            errors.join("\n  ")
        );
    }

    /// A body the code refused as malformed is one the document refuses too.
    fn check_request_refused(&self, method: &str, template: &str, body: &Value) {
        let op = self.operation(method, template);
        let schema = &self.resolve(&op["requestBody"])["content"]["application/json"]["schema"];
        let mut errors = Vec::new();
        self.validate(schema, body, "request", &mut errors);
        assert!(
            !errors.is_empty(),
            "{method} {template}: the document accepts a body the code refuses: {body:#}"
        );
    }

    /// Checks one real response against the document; returns its JSON body.
    fn check_response(
        &self,
        method: &str,
        template: &str,
        status: u16,
        headers: &reqwest::header::HeaderMap,
        body: &[u8],
    ) -> Value {
        self.seen.lock().expect("lock").insert((method.to_string(), template.to_string(), status));
        let op = self.operation(method, template);
        let text = String::from_utf8_lossy(body);
        let Some(documented) =
            op["responses"].get(status.to_string()).or_else(|| op["responses"].get("default"))
        else {
            panic!("{method} {template} answered {status}, which the document does not list: {text}");
        };
        let documented = self.resolve(documented);
        let mut errors = Vec::new();
        for (name, h) in documented["headers"].as_object().into_iter().flatten() {
            let h = self.resolve(h);
            match headers.get(name.as_str()).map(|v| v.to_str().unwrap_or("")) {
                Some(v) => self.validate(&h["schema"], &json!(v), &format!("header {name}"), &mut errors),
                None if h["required"] == true => errors.push(format!("required header {name} is missing")),
                None => {}
            }
        }
        let content_type = headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("");
        let essence = content_type.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
        let value = match documented["content"].as_object() {
            None => {
                if !body.is_empty() {
                    errors.push(format!("a body ({content_type}) where the document describes none"));
                }
                Value::Null
            }
            Some(content) => match content.get(&essence) {
                None => {
                    errors.push(format!(
                        "content type {content_type:?} is not among the documented {:?}",
                        content.keys().collect::<Vec<_>>()
                    ));
                    Value::Null
                }
                Some(media) => {
                    let value = if essence == "application/json" {
                        serde_json::from_slice(body).unwrap_or_else(|e| {
                            errors.push(format!("not JSON: {e}"));
                            Value::Null
                        })
                    } else {
                        Value::String(text.to_string())
                    };
                    self.validate(&media["schema"], &value, "body", &mut errors);
                    value
                }
            },
        };
        assert!(
            errors.is_empty(),
            "{method} {template} answered {status} against the document:\n  {}\nbody: {text}",
            errors.join("\n  ")
        );
        value
    }

    /// A JSON Schema (2020-12, as OpenAPI 3.1 uses it) checker for the
    /// keywords docs/openapi.json uses; an unknown keyword fails, so the
    /// document cannot outgrow the checker unnoticed.
    fn validate(&self, schema: &Value, v: &Value, at: &str, errors: &mut Vec<String>) {
        let s = match schema {
            Value::Bool(true) => return,
            Value::Bool(false) => return errors.push(format!("{at}: nothing is allowed here")),
            Value::Object(s) => s,
            other => return errors.push(format!("{at}: not a schema: {other}")),
        };
        for key in s.keys() {
            const KNOWN: &[&str] = &[
                "$ref",
                "type",
                "enum",
                "const",
                "allOf",
                "anyOf",
                "oneOf",
                "not",
                "if",
                "then",
                "else",
                "required",
                "properties",
                "additionalProperties",
                "propertyNames",
                "minProperties",
                "maxProperties",
                "items",
                "minItems",
                "maxItems",
                "uniqueItems",
                "minLength",
                "maxLength",
                "pattern",
                "format",
                "minimum",
                "maximum",
                "description",
                "title",
                "example",
                "examples",
                "default",
            ];
            if !KNOWN.contains(&key.as_str()) {
                errors.push(format!("{at}: the checker does not know the keyword `{key}`; teach it"));
            }
        }
        if let Some(r) = s.get("$ref").and_then(Value::as_str) {
            match self.pointer(r) {
                Some(target) => self.validate(target, v, at, errors),
                None => errors.push(format!("{at}: unresolved $ref {r}")),
            }
        }
        if let Some(t) = s.get("type") {
            let types: Vec<&str> = match t {
                Value::String(t) => vec![t.as_str()],
                Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
                _ => vec![],
            };
            if !types.iter().any(|t| type_matches(t, v)) {
                return errors.push(format!("{at}: {} is not of type {types:?}", short(v)));
            }
        }
        if let Some(e) = s.get("enum").and_then(Value::as_array)
            && !e.contains(v)
        {
            errors.push(format!("{at}: {} is not one of {}", short(v), Value::Array(e.clone())));
        }
        if let Some(c) = s.get("const")
            && c != v
        {
            errors.push(format!("{at}: {} is not {c}", short(v)));
        }
        for sub in s.get("allOf").and_then(Value::as_array).into_iter().flatten() {
            self.validate(sub, v, at, errors);
        }
        let passes = |sub: &Value| {
            let mut e = Vec::new();
            self.validate(sub, v, at, &mut e);
            e.is_empty()
        };
        if let Some(not) = s.get("not")
            && passes(not)
        {
            errors.push(format!("{at}: {} matches a schema it must not ({not})", short(v)));
        }
        if let Some(cond) = s.get("if") {
            let branch = if passes(cond) { s.get("then") } else { s.get("else") };
            if let Some(b) = branch {
                self.validate(b, v, at, errors);
            }
        }
        for (kw, want_one) in [("anyOf", false), ("oneOf", true)] {
            if let Some(subs) = s.get(kw).and_then(Value::as_array) {
                let passing = subs.iter().filter(|sub| passes(sub)).count();
                if passing == 0 || (want_one && passing > 1) {
                    errors.push(format!("{at}: {} matches {passing} of the {kw} schemas", short(v)));
                }
            }
        }
        let num = |k: &str| s.get(k).and_then(Value::as_f64);
        let count = |k: &str| s.get(k).and_then(Value::as_u64).map(|n| n as usize);
        match v {
            Value::Object(m) => {
                for r in s.get("required").and_then(Value::as_array).into_iter().flatten() {
                    let r = r.as_str().expect("required names");
                    if !m.contains_key(r) {
                        errors.push(format!("{at}: the required property `{r}` is missing"));
                    }
                }
                let props = s.get("properties").and_then(Value::as_object);
                for (k, val) in m {
                    let here = format!("{at}.{k}");
                    if let Some(p) = props.and_then(|p| p.get(k)) {
                        self.validate(p, val, &here, errors);
                    } else if let Some(extra) = s.get("additionalProperties") {
                        if extra == &Value::Bool(false) {
                            errors.push(format!("{at}: `{k}` is not a documented property"));
                        } else {
                            self.validate(extra, val, &here, errors);
                        }
                    }
                    if let Some(names) = s.get("propertyNames") {
                        self.validate(names, &json!(k), &format!("{at} (property name {k:?})"), errors);
                    }
                }
                if count("maxProperties").is_some_and(|n| m.len() > n)
                    || count("minProperties").is_some_and(|n| m.len() < n)
                {
                    errors.push(format!("{at}: {} properties is out of bounds", m.len()));
                }
            }
            Value::Array(a) => {
                if let Some(items) = s.get("items") {
                    for (i, item) in a.iter().enumerate() {
                        self.validate(items, item, &format!("{at}[{i}]"), errors);
                    }
                }
                if count("maxItems").is_some_and(|n| a.len() > n)
                    || count("minItems").is_some_and(|n| a.len() < n)
                {
                    errors.push(format!("{at}: {} items is out of bounds", a.len()));
                }
                if s.get("uniqueItems") == Some(&Value::Bool(true))
                    && a.iter().enumerate().any(|(i, x)| a[..i].contains(x))
                {
                    errors.push(format!("{at}: items repeat"));
                }
            }
            Value::String(text) => {
                let n = text.chars().count();
                if count("maxLength").is_some_and(|m| n > m) || count("minLength").is_some_and(|m| n < m) {
                    errors.push(format!("{at}: a string of {n} characters is out of bounds"));
                }
                if let Some(p) = s.get("pattern").and_then(Value::as_str) {
                    match pattern_holds(p, text) {
                        Some(true) => {}
                        Some(false) => errors.push(format!("{at}: {text:?} does not match {p}")),
                        None => {
                            errors.push(format!("{at}: the checker does not know the pattern {p}; teach it"))
                        }
                    }
                }
                match s.get("format").and_then(Value::as_str) {
                    None | Some("int64") => {}
                    Some("date-time") => {
                        if chrono::DateTime::parse_from_rfc3339(text).is_err() {
                            errors.push(format!("{at}: {text:?} is not an RFC 3339 date-time"));
                        }
                    }
                    Some(f) => errors.push(format!("{at}: the checker does not know the format {f}")),
                }
            }
            Value::Number(x) => {
                let x = x.as_f64().expect("finite");
                if num("minimum").is_some_and(|m| x < m) || num("maximum").is_some_and(|m| x > m) {
                    errors.push(format!("{at}: {x} is out of bounds"));
                }
            }
            _ => {}
        }
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 120 { format!("{}…", &s[..s.floor_char_boundary(120)]) } else { s }
}

fn type_matches(t: &str, v: &Value) -> bool {
    match t {
        "null" => v.is_null(),
        "boolean" => v.is_boolean(),
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "number" => v.is_number(),
        "integer" => v.is_i64() || v.is_u64() || v.as_f64().is_some_and(|f| f.fract() == 0.0),
        _ => false,
    }
}

/// The regular expressions docs/openapi.json uses, each as the predicate
/// the code applies (no regex crate); `None` for one the checker does not know.
fn pattern_holds(pattern: &str, s: &str) -> Option<bool> {
    let control_but_tab_newline = |c: char| c.is_control() && c != '\t' && c != '\n';
    let hex = |h: &str, n: usize| h.len() == n && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    Some(match pattern {
        r"^op_[0-9a-f]{26}$" => s.strip_prefix("op_").is_some_and(|h| hex(h, 26)),
        r"^[0-9a-f]{40}$" => hex(s, 40),
        r"^[A-Za-z0-9_-]{1,64}$" => {
            (1..=64).contains(&s.len())
                && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        }
        r"\S" => s.chars().any(|c| !c.is_whitespace()),
        // An id: no control characters, no surrounding white space.
        r"^[^\s\x00-\x1f\x7f-\x9f](?:[^\x00-\x1f\x7f-\x9f]*[^\s\x00-\x1f\x7f-\x9f])?$" => {
            !s.is_empty() && !s.chars().any(char::is_control) && s.trim() == s
        }
        // Text: no control characters but tab and newline.
        r"^[^\x00-\x08\x0b-\x1f\x7f-\x9f]*$" => !s.chars().any(control_but_tab_newline),
        // Text that is not blank.
        r"^[^\x00-\x08\x0b-\x1f\x7f-\x9f]*[^\s\x00-\x1f\x7f-\x9f][^\x00-\x08\x0b-\x1f\x7f-\x9f]*$" => {
            !s.chars().any(control_but_tab_newline)
                && s.chars().any(|c| !c.is_whitespace() && !c.is_control())
        }
        _ => return None,
    })
}

/// Sends requests to one approvald and checks every answer against the contract.
struct Probe<'a> {
    app: &'a TestApp,
    contract: &'a Contract,
}

impl Probe<'_> {
    async fn call(
        &self,
        method: &str,
        template: &str,
        path: &str,
        build: impl FnOnce(RequestBuilder) -> RequestBuilder,
    ) -> (u16, Value) {
        let m = Method::from_bytes(method.as_bytes()).expect("method");
        let req = build(self.app.http.request(m, format!("{}{path}", self.app.base)));
        let resp = req.send().await.unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let body = resp.bytes().await.expect("body");
        (status, self.contract.check_response(method, template, status, &headers, &body))
    }

    /// A bearer-authenticated request.
    async fn authed(
        &self,
        method: &str,
        template: &str,
        path: &str,
        build: impl FnOnce(RequestBuilder) -> RequestBuilder,
    ) -> (u16, Value) {
        self.call(method, template, path, |r| build(r.bearer_auth(TOKEN))).await
    }

    /// `POST /v1/operations` with a JSON body; a body the code accepts must
    /// be one the document accepts.
    async fn enqueue(&self, body: &Value) -> (u16, Value) {
        let (status, v) = self.authed("POST", "/v1/operations", "/v1/operations", |r| r.json(body)).await;
        if status < 300 {
            self.contract.check_request("POST", "/v1/operations", body);
        }
        // A refusal the schema can express (all but configuration and clock
        // dependent ones) must be one the document makes too.
        if status == 422 && !matches!(code(&v), "unknown_effect") && v["field"] != "deadline" {
            self.contract.check_request_refused("POST", "/v1/operations", body);
        }
        (status, v)
    }

    async fn get_op(&self, id: &str) -> Value {
        let (status, v) =
            self.authed("GET", "/v1/operations/{id}", &format!("/v1/operations/{id}"), |r| r).await;
        assert_eq!(status, 200, "{v}");
        v
    }

    async fn wait_op(&self, id: &str, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
        let start = Instant::now();
        loop {
            let op = self.get_op(id).await;
            if cond(&op) {
                return op;
            }
            assert!(start.elapsed() < WAIT, "{id}: {what} never happened: {op:#}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn callback(
        &self,
        template: &str,
        path: &str,
        body: &[u8],
        signature: Option<&str>,
    ) -> (u16, Value) {
        let body = body.to_vec();
        let sig = signature.map(str::to_string);
        self.call("POST", template, path, move |mut r| {
            r = r.header("content-type", "application/json").body(body);
            if let Some(s) = sig {
                r = r.header("X-Pushary-Signature", s);
            }
            r
        })
        .await
    }

    async fn cancel(&self, id: &str) -> (u16, Value) {
        self.authed("DELETE", "/v1/operations/{id}", &format!("/v1/operations/{id}"), |r| r).await
    }

    async fn resolve(&self, id: &str, build: impl FnOnce(RequestBuilder) -> RequestBuilder) -> (u16, Value) {
        self.authed("POST", "/v1/operations/{id}/resolve", &format!("/v1/operations/{id}/resolve"), build)
            .await
    }
}

fn code(v: &Value) -> &str {
    v["code"].as_str().unwrap_or("")
}

both_engines! {
async fn real_responses_of_every_status_class_conform_to_the_document() {
    let contract = Contract::new();
    let app = TestApp::spawn().await;
    let p = Probe { app: &app, contract: &contract };

    // Health and the document itself.
    assert_eq!(p.call("GET", "/healthz", "/healthz", |r| r).await.0, 200);
    assert_eq!(p.call("GET", "/readyz", "/readyz", |r| r).await.0, 200);
    assert_eq!(p.call("GET", "/openapi.json", "/openapi.json", |r| r).await.0, 200);
    assert_eq!(p.call("GET", "/metrics", "/metrics", |r| r).await.0, 200);
    // Request headers over `server.max_header_bytes`.
    let big = "x".repeat(17 * 1024);
    let (status, _) = p.call("GET", "/healthz", "/healthz", |r| r.header("x-padding", big.as_str())).await;
    assert_eq!(status, 431);

    // Enqueue: new, the same again, a conflict, and every refusal.
    let body = confirm("openapi");
    let (status, first) = p.enqueue(&body).await;
    assert_eq!(status, 201, "{first}");
    let id = first["id"].as_str().expect("id").to_string();
    assert_eq!(p.enqueue(&body).await.0, 200);
    let mut changed = body.clone();
    changed["question"] = json!("Refund 41 EUR?");
    let (status, v) = p.enqueue(&changed).await;
    assert_eq!((status, code(&v)), (409, "operation_key_conflict"));
    let minimal = json!({"operationKey": "openapi-min", "threadId": "t-min", "interruptId": "i", "effect": "orders",
                         "externalId": "user-1", "question": "Ship it?", "type": null, "expiresInSeconds": 600});
    assert_eq!(p.enqueue(&minimal).await.0, 201);
    let select = json!({"operationKey": "openapi-select", "threadId": "t-select", "interruptId": "i",
                        "effect": "orders", "externalId": "user-1", "question": "Which one?", "type": "select",
                        "options": ["small", "large"], "context": "line one\nline two", "placeholder": "pick",
                        "agentName": "agent", "presentation": {"color": "red"},
                        "deadline": (chrono::Utc::now() + chrono::Duration::minutes(30)).to_rfc3339()});
    assert_eq!(p.enqueue(&select).await.0, 201);
    let (status, v) = p.call("POST", "/v1/operations", "/v1/operations", |r| r.json(&body)).await;
    assert_eq!((status, code(&v)), (401, "unauthorized"));
    let (status, _) = p
        .call("POST", "/v1/operations", "/v1/operations", |r| r.bearer_auth("not-the-token-0123456789").json(&body))
        .await;
    assert_eq!(status, 401);
    let (status, _) = p
        .authed("POST", "/v1/operations", "/v1/operations", |r| {
            r.header("content-type", "text/plain").body(body.to_string())
        })
        .await;
    assert_eq!(status, 415);
    let huge = format!("{{\"question\": \"{}\"}}", "x".repeat(300 * 1024));
    let (status, _) = p
        .authed("POST", "/v1/operations", "/v1/operations", |r| {
            r.header("content-type", "application/json").body(huge)
        })
        .await;
    assert_eq!(status, 413);
    for (bad, want) in [("{not json", "invalid_json"), (r#"{"a": 1, "a": 2}"#, "duplicate_key")] {
        let (status, v) = p
            .authed("POST", "/v1/operations", "/v1/operations", |r| {
                r.header("content-type", "application/json").body(bad)
            })
            .await;
        assert_eq!((status, code(&v)), (400, want));
    }
    let mut unknown = body.clone();
    unknown["surprise"] = json!(1);
    let (status, v) = p.enqueue(&unknown).await;
    assert_eq!((status, v["field"].as_str()), (422, Some("surprise")));
    let (status, v) = p.enqueue(&json!([1])).await;
    assert_eq!((status, code(&v), v.get("field")), (422, "invalid_body", None));
    let bounds: Vec<(&str, Value)> = vec![
        ("options", json!(["a", "b"])),
        ("type", json!("select")),
        ("type", json!("vote")),
        ("question", json!(" \n ")),
        ("question", json!("q".repeat(501))),
        ("externalId", json!(" ")),
        ("threadId", json!(" t")),
        ("operationKey", json!("a\u{7}b")),
        ("toolName", json!("")),
        ("parameters", json!({"nested": {"a": 1}})),
        ("parameters", json!({"": 1})),
        ("parameters", json!({"long": "v".repeat(201)})),
        ("expiresInSeconds", json!(0)),
        ("expiresInSeconds", json!("60")),
        ("presentation", json!([1])),
        ("effect", json!("../etc")),
    ];
    for (key, value) in bounds {
        let mut bad = body.clone();
        bad["operationKey"] = json!("openapi-bounds");
        bad[key] = value.clone();
        let (status, v) = p.enqueue(&bad).await;
        assert_eq!(status, 422, "{key}={value}: {v}");
    }
    let mut both = body.clone();
    both["operationKey"] = json!("openapi-both");
    both["expiresInSeconds"] = json!(60);
    both["deadline"] = json!((chrono::Utc::now() + chrono::Duration::minutes(30)).to_rfc3339());
    assert_eq!(p.enqueue(&both).await.0, 422);
    contract.check_request_refused("POST", "/v1/operations", &both);
    let mut nowhere = body.clone();
    nowhere["effect"] = json!("nowhere");
    let (status, v) = p.enqueue(&nowhere).await;
    assert_eq!((status, code(&v)), (422, "unknown_effect"));

    // Read and list.
    let pending = p.wait_op(&id, "pending", |o| o["state"] == "pending").await;
    let decision = pending["decisionId"].as_str().expect("decision").to_string();
    let (status, v) = p.authed("GET", "/v1/operations", "/v1/operations", |r| r).await;
    assert_eq!(status, 200);
    assert!(v["operations"].as_array().is_some_and(|a| a.len() >= 3), "{v}");
    let (status, _) = p
        .authed("GET", "/v1/operations", "/v1/operations?state=pending&threadId=thread-openapi&limit=5", |r| r)
        .await;
    assert_eq!(status, 200);
    for bad in ["?limit=0", "?state=nope", "?bogus=1", "?limit=ten"] {
        let (status, v) = p.authed("GET", "/v1/operations", &format!("/v1/operations{bad}"), |r| r).await;
        assert_eq!((status, code(&v)), (400, "invalid_query"), "{bad}");
    }
    assert_eq!(p.call("GET", "/v1/operations", "/v1/operations", |r| r).await.0, 401);
    let (status, v) = p.authed("GET", "/v1/operations/{id}", "/v1/operations/op_nope", |r| r).await;
    assert_eq!((status, code(&v)), (404, "not_found"));
    assert_eq!(p.call("GET", "/v1/operations/{id}", &format!("/v1/operations/{id}"), |r| r).await.0, 401);

    // Callbacks: the sandbox answers yes; replays and forgeries.
    app.answer(&decision, "yes").await;
    let sent = app.sandbox.decision(&decision).expect("decision").callback.body.expect("callback sent");
    let sig = approvald::pushary::signature::sign(&app.webhook_secret, sent.as_bytes());
    let cb = "/v1/callbacks/pushary";
    let tcb = "/v1/callbacks/pushary/{tenant}";
    // The sandbox's own delivery of it may still be on its way: either is first.
    let (status, v) = p.callback(cb, cb, sent.as_bytes(), Some(&sig)).await;
    assert!(status == 200 && (v["status"] == "stored" || v["status"] == "duplicate"), "{status} {v}");
    let replay = p.callback(tcb, "/v1/callbacks/pushary/default", sent.as_bytes(), Some(&sig)).await;
    assert_eq!(replay, (200, json!({"status": "duplicate"})));
    let (orphan, orphan_sig) = app.signed_callback("dec_openapi_unknown", "yes");
    assert_eq!(p.callback(cb, cb, &orphan, Some(&orphan_sig)).await, (200, json!({"status": "stored"})));
    assert_eq!(p.callback(cb, cb, sent.as_bytes(), None).await.0, 401);
    assert_eq!(p.callback(cb, cb, sent.as_bytes(), Some(&"0".repeat(64))).await.0, 401);
    for (bad, want) in [
        (&b"{nope"[..], "invalid_json"),
        (&br#"{"correlationId": "d"}"#[..], "not_a_decision_callback"),
        (&br#"{"correlationId": "", "answer": "yes"}"#[..], "invalid_correlation_id"),
    ] {
        let s = approvald::pushary::signature::sign(&app.webhook_secret, bad);
        let (status, v) = p.callback(cb, cb, bad, Some(&s)).await;
        assert_eq!((status, code(&v)), (400, want));
    }
    let (status, v) = p.callback(tcb, "/v1/callbacks/pushary/nobody", sent.as_bytes(), Some(&sig)).await;
    assert_eq!((status, code(&v)), (404, "not_found"));
    let (status, _) = p.callback(cb, cb, " ".repeat(70 * 1024).as_bytes(), Some(&sig)).await;
    assert_eq!(status, 413);

    // The approved operation, finished: permit, outcome, delivery, receipt, result.
    let done = p
        .wait_op(&id, "finished", |o| o["state"] == "succeeded" && o["receipt"] != "pending")
        .await;
    assert!(done["permitId"].is_string() && done["deliveries"].as_array().is_some_and(|d| !d.is_empty()), "{done:#}");
    let (status, _) = p.authed("GET", "/v1/operations", "/v1/operations?state=succeeded", |r| r).await;
    assert_eq!(status, 200);

    // The inbox.
    let (status, v) = p.authed("GET", "/v1/inbox", "/v1/inbox", |r| r).await;
    assert_eq!(status, 200);
    let entry = v["entries"].as_array().and_then(|e| e.first()).expect("an entry")["id"].clone();
    let (status, v) = p.authed("GET", "/v1/inbox/{id}", &format!("/v1/inbox/{entry}"), |r| r).await;
    assert!(status == 200 && v["body"].is_string(), "{v}");
    assert_eq!(p.authed("GET", "/v1/inbox", "/v1/inbox?state=new&limit=10", |r| r).await.0, 200);
    for bad in ["?state=nope", "?limit=5000", "?other=1"] {
        let (status, v) = p.authed("GET", "/v1/inbox", &format!("/v1/inbox{bad}"), |r| r).await;
        assert_eq!((status, code(&v)), (400, "invalid_query"), "{bad}");
    }
    for missing in ["999999999", "abc"] {
        let (status, _) = p.authed("GET", "/v1/inbox/{id}", &format!("/v1/inbox/{missing}"), |r| r).await;
        assert_eq!(status, 404);
    }
    assert_eq!(p.call("GET", "/v1/inbox", "/v1/inbox", |r| r).await.0, 401);
    assert_eq!(p.call("GET", "/v1/inbox/{id}", &format!("/v1/inbox/{entry}"), |r| r).await.0, 401);

    // Resolve: only an uncertain operation; every refusal.
    let (status, v) = p.resolve(&id, |r| r.json(&json!({"outcome": "failed", "note": "n", "by": "bob"}))).await;
    assert_eq!((status, code(&v)), (409, "not_uncertain"));
    let (status, v) = p.resolve(&id, |r| r.json(&json!({"outcome": "maybe", "note": "n", "by": "bob"}))).await;
    assert_eq!((status, v["field"].as_str()), (422, Some("outcome")));
    let (status, v) = p.resolve(&id, |r| r.json(&json!({"outcome": "failed", "by": "bob"}))).await;
    assert_eq!((status, code(&v)), (422, "missing_field"));
    let (status, v) = p.resolve(&id, |r| r.json(&json!({"outcome": "failed", "note": "n", "by": " "}))).await;
    assert_eq!((status, code(&v)), (400, "out_of_bounds"));
    let (status, _) = p.resolve(&id, |r| r.header("content-type", "text/plain").body("{}")).await;
    assert_eq!(status, 415);
    let (status, _) =
        p.resolve(&id, |r| r.header("content-type", "application/json").body(" ".repeat(17 * 1024))).await;
    assert_eq!(status, 413);
    let (status, _) = p.resolve(&id, |r| r.header("content-type", "application/json").body("{")).await;
    assert_eq!(status, 400);
    let (status, _) =
        p.resolve("op_nope", |r| r.json(&json!({"outcome": "failed", "note": "n", "by": "bob"}))).await;
    assert_eq!(status, 404);
    let (status, _) = p
        .call("POST", "/v1/operations/{id}/resolve", &format!("/v1/operations/{id}/resolve"), |r| {
            r.json(&json!({"outcome": "failed", "note": "n", "by": "bob"}))
        })
        .await;
    assert_eq!(status, 401);

    // Cancel: a pending operation, then again, then an unknown one.
    let cancel_id = p.enqueue(&confirm("openapi-cancel")).await.1["id"].as_str().expect("id").to_string();
    p.wait_op(&cancel_id, "pending", |o| o["state"] == "pending").await;
    let (status, v) = p.cancel(&cancel_id).await;
    assert_eq!((status, v["state"].as_str()), (200, Some("cancelled")));
    let (status, v) = p.cancel(&cancel_id).await;
    assert_eq!((status, code(&v)), (409, "not_cancellable"));
    assert_eq!(p.cancel("op_nope").await.0, 404);
    assert_eq!(p.call("DELETE", "/v1/operations/{id}", "/v1/operations/op_nope", |r| r).await.0, 401);
    // Pushary failing the cancel: 502, nothing changed.
    let outage_id = p.enqueue(&confirm("openapi-outage")).await.1["id"].as_str().expect("id").to_string();
    p.wait_op(&outage_id, "pending", |o| o["state"] == "pending").await;
    app.sandbox.fail_next_api_calls(500, 1);
    let (status, v) = p.cancel(&outage_id).await;
    app.sandbox.fail_next_api_calls(500, 0);
    assert_eq!((status, code(&v)), (502, "pushary_unavailable"));

    // An uncertain operation (the effect target never confirms), resolved.
    app.sandbox.set_effect_response(503, 10_000);
    let mut body = confirm("openapi-uncertain");
    body["expiresInSeconds"] = json!(3);
    let uncertain = p.enqueue(&body).await.1["id"].as_str().expect("id").to_string();
    let decision = p.wait_op(&uncertain, "pending", |o| o["state"] == "pending").await["decisionId"]
        .as_str()
        .expect("decision")
        .to_string();
    app.answer(&decision, "yes").await;
    p.wait_op(&uncertain, "uncertain", |o| o["state"] == "uncertain").await;
    app.sandbox.set_effect_response(200, 0);
    let (status, v) =
        p.resolve(&uncertain, |r| r.json(&json!({"outcome": "succeeded", "note": "seen in the ledger", "by": "ann"})))
            .await;
    assert_eq!((status, v["state"].as_str()), (200, Some("succeeded")), "{v}");
    p.get_op(&uncertain).await;

    // A row this version cannot read: 500 store_corrupt.
    let minimal_id = p.authed("GET", "/v1/operations", "/v1/operations?threadId=t-min", |r| r).await.1["operations"][0]
        ["id"]
        .as_str()
        .expect("the minimal operation")
        .to_string();
    corrupt_operation(&app, &minimal_id).await;
    let (status, v) = p.authed("GET", "/v1/operations/{id}", &format!("/v1/operations/{minimal_id}"), |r| r).await;
    assert_eq!((status, code(&v)), (500, "store_corrupt"));

    // Archived operations: their document, and enqueue answering with it.
    let archiving = TestApp::spawn_with(Options { archive_after_ms: Some(0), ..Options::default() }).await;
    let a = Probe { app: &archiving, contract: &contract };
    let body = confirm("openapi-archived");
    let archived_id = a.enqueue(&body).await.1["id"].as_str().expect("id").to_string();
    let decision = a.wait_op(&archived_id, "pending", |o| o["state"] == "pending").await["decisionId"]
        .as_str()
        .expect("decision")
        .to_string();
    archiving.answer(&decision, "no").await;
    a.wait_op(&archived_id, "delivered", |o| o["delivery"] == "done").await;
    let sweep = archiving.engine.reconcile_once().await.expect("sweep");
    assert_eq!(sweep.archived, 1, "{sweep:?}");
    assert!(a.get_op(&archived_id).await["archivedAt"].is_string());
    assert_eq!(a.enqueue(&body).await.0, 200);
    let mut changed = body.clone();
    changed["question"] = json!("Something else?");
    assert_eq!(a.enqueue(&changed).await.0, 409);
    let (status, v) = a.cancel(&archived_id).await;
    assert_eq!((status, code(&v)), (409, "not_cancellable"));
    drop(archiving);

    // A request that does not arrive in time: 408.
    let slow = TestApp::spawn_with(Options { server_toml: "request_timeout_secs = 1".into(), ..Options::default() })
        .await;
    let (status, headers, body) = half_sent_request(&slow.base).await;
    contract.check_response("POST", "/v1/operations", status, &headers, &body);
    assert_eq!(status, 408);

    // Every documented operation was exercised.
    let seen = contract.seen.lock().expect("lock").clone();
    let exercised: BTreeSet<(String, String)> = seen.iter().map(|(m, p, _)| (m.clone(), p.clone())).collect();
    let untested: Vec<_> = documented_routes(&contract.doc).difference(&exercised).cloned().collect();
    assert!(untested.is_empty(), "documented but never exercised here: {untested:?}");
    let mut by_op: BTreeMap<String, Vec<u16>> = BTreeMap::new();
    for (m, path, s) in seen {
        by_op.entry(format!("{m} {path}")).or_default().push(s);
    }
    eprintln!("openapi conformance, statuses seen: {by_op:?}");
}
}

both_engines! {
/// A path parameter that is not UTF-8 once percent-decoded, or holds a NUL,
/// names nothing: 404 in the documented error shape (axum's own rejection
/// was a 400 text/plain, and PostgreSQL refused the NUL as if the store
/// were down: 503).
async fn a_path_parameter_that_is_not_utf8_or_holds_nul_is_answered_in_the_documented_shape() {
    let contract = Contract::new();
    let app = TestApp::spawn().await;
    let p = Probe { app: &app, contract: &contract };
    for bad in ["%FF", "op%00x"] {
        for (method, template, path) in [
            ("GET", "/v1/operations/{id}", format!("/v1/operations/{bad}")),
            ("DELETE", "/v1/operations/{id}", format!("/v1/operations/{bad}")),
            ("POST", "/v1/operations/{id}/resolve", format!("/v1/operations/{bad}/resolve")),
            ("GET", "/v1/inbox/{id}", format!("/v1/inbox/{bad}")),
        ] {
            let body = json!({"outcome": "failed", "note": "n", "by": "bob"});
            let (status, v) = p.authed(method, template, &path, |r| r.json(&body)).await;
            assert_eq!((status, v["code"].as_str()), (404, Some("not_found")), "{method} {path}: {v}");
        }
        let (body, sig) = app.signed_callback("dec_1", "yes");
        let path = format!("/v1/callbacks/pushary/{bad}");
        let (status, _) = p.callback("/v1/callbacks/pushary/{tenant}", &path, &body, Some(&sig)).await;
        assert_eq!(status, 404, "{path}");
    }
    let (status, v) =
        p.authed("GET", "/v1/operations", "/v1/operations?threadId=a%00b", |r| r).await;
    assert_eq!((status, v["code"].as_str()), (400, Some("invalid_query")), "{v}");
}
}

/// Makes an operation's stored spec unreadable, as data from another
/// version would be.
async fn corrupt_operation(app: &TestApp, id: &str) {
    use sqlx::Connection as _;
    let sql = "UPDATE operations SET spec = 'not json' WHERE id = $1";
    let url = app.store_url();
    let changed = if url.starts_with("postgres") {
        let mut c = sqlx::PgConnection::connect(&url).await.expect("connect");
        sqlx::query(sql).bind(id).execute(&mut c).await.expect("update").rows_affected()
    } else {
        let mut c = sqlx::SqliteConnection::connect(&url).await.expect("connect");
        sqlx::query(sql).bind(id).execute(&mut c).await.expect("update").rows_affected()
    };
    assert_eq!(changed, 1);
}

/// Sends an enqueue whose body never completes, and reads the answer.
async fn half_sent_request(base: &str) -> (u16, reqwest::header::HeaderMap, Vec<u8>) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let addr = base.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "POST /v1/operations HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {TOKEN}\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{"
    );
    s.write_all(head.as_bytes()).await.expect("write");
    let mut raw = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), async {
        let mut buf = [0u8; 4096];
        loop {
            let n = s.read(&mut buf).await.expect("read");
            if n == 0 {
                break;
            }
            raw.extend_from_slice(&buf[..n]);
            if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
                let len = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse::<usize>().ok());
                if len.is_some_and(|len| raw.len() >= end + 4 + len) {
                    break;
                }
            }
        }
    })
    .await;
    assert!(read.is_ok(), "no answer within 10 s: {}", String::from_utf8_lossy(&raw));
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("a response head");
    let head = String::from_utf8_lossy(&raw[..end]).to_string();
    let mut lines = head.split("\r\n");
    let status: u16 =
        lines.next().and_then(|l| l.split(' ').nth(1)).and_then(|s| s.parse().ok()).expect("a status line");
    let mut headers = reqwest::header::HeaderMap::new();
    for line in lines {
        if let Some((k, v)) = line.split_once(':') {
            headers.append(
                reqwest::header::HeaderName::from_bytes(k.trim().as_bytes()).expect("name"),
                reqwest::header::HeaderValue::from_str(v.trim()).expect("value"),
            );
        }
    }
    (status, headers, raw[end + 4..].to_vec())
}

//! Strict JSON for bodies from outside: UTF-8 only, no duplicate keys (two
//! parsers could otherwise read different values from the same signed
//! bytes), and bounded nesting.

use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

pub const MAX_DEPTH: usize = 32;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JsonError {
    NotUtf8,
    DuplicateKey(String),
    TooDeep,
    Syntax(String),
}

impl JsonError {
    pub fn code(&self) -> &'static str {
        match self {
            JsonError::NotUtf8 => "invalid_utf8",
            JsonError::DuplicateKey(_) => "duplicate_key",
            JsonError::TooDeep => "too_deep",
            JsonError::Syntax(_) => "invalid_json",
        }
    }
}

impl fmt::Display for JsonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JsonError::NotUtf8 => f.write_str("the body is not valid UTF-8"),
            JsonError::DuplicateKey(k) => write!(f, "the key `{k}` appears twice in one object"),
            JsonError::TooDeep => write!(f, "the JSON nests deeper than {MAX_DEPTH} levels"),
            JsonError::Syntax(e) => write!(f, "the body is not valid JSON: {e}"),
        }
    }
}

const DUPLICATE: &str = "\u{0}duplicate:";
const DEEP: &str = "\u{0}too-deep";

pub fn parse_strict(bytes: &[u8]) -> Result<Value, JsonError> {
    if std::str::from_utf8(bytes).is_err() {
        return Err(JsonError::NotUtf8);
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = Strict { depth: 0 }.deserialize(&mut de).map_err(classify)?;
    de.end().map_err(classify)?;
    Ok(value)
}

fn classify(e: serde_json::Error) -> JsonError {
    let msg = e.to_string();
    if let Some(rest) = msg.strip_prefix(DUPLICATE) {
        let key = rest.split(" at line ").next().unwrap_or(rest);
        JsonError::DuplicateKey(key.to_string())
    } else if msg.starts_with(DEEP) || msg.starts_with("recursion limit exceeded") {
        JsonError::TooDeep
    } else {
        JsonError::Syntax(msg)
    }
}

struct Strict {
    depth: usize,
}

impl<'de> DeserializeSeed<'de> for Strict {
    type Value = Value;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Strict {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Number::from_f64(v).map(Value::Number).ok_or_else(|| E::custom("numbers must be finite"))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        if self.depth >= MAX_DEPTH {
            return Err(de::Error::custom(DEEP));
        }
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(Strict { depth: self.depth + 1 })? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        if self.depth >= MAX_DEPTH {
            return Err(de::Error::custom(DEEP));
        }
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                return Err(de::Error::custom(format!("{DUPLICATE}{key}")));
            }
            let v = map.next_value_seed(Strict { depth: self.depth + 1 })?;
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_ordinary_json() {
        let v = parse_strict(br#"{"a": [1, 2.5, "x", null, true, {"b": -3}]}"#).expect("valid");
        assert_eq!(v["a"][5]["b"], -3);
    }

    #[test]
    fn refuses_what_parsers_could_read_differently() {
        assert_eq!(
            parse_strict(br#"{"answer": "no", "answer": "yes"}"#),
            Err(JsonError::DuplicateKey("answer".into()))
        );
        assert_eq!(parse_strict(br#"{"a": {"k": 1, "k": 2}}"#).map_err(|e| e.code()), Err("duplicate_key"));
        assert_eq!(parse_strict(b"{\"a\": \"\xff\"}"), Err(JsonError::NotUtf8));
        let deep = format!("{}{}", "[".repeat(40), "]".repeat(40));
        assert_eq!(parse_strict(deep.as_bytes()), Err(JsonError::TooDeep));
        let ok = format!("{}{}", "[".repeat(32), "]".repeat(32));
        assert!(parse_strict(ok.as_bytes()).is_ok());
        for bad in [&b"NaN"[..], b"{\"a\": NaN}", b"1e400", b"{\"a\": 1} trailing", b"", b"{"] {
            assert_eq!(
                parse_strict(bad).map_err(|e| e.code()),
                Err("invalid_json"),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}

#[cfg(test)]
mod properties {
    use proptest::prelude::*;
    use serde_json::Value;

    use super::*;

    fn values() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<String>().prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::btree_map(any::<String>(), inner, 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Whatever serde_json writes (no duplicate keys by construction), the strict parser reads back.
        #[test]
        fn strict_parsing_round_trips(v in values()) {
            let bytes = serde_json::to_vec(&v).expect("serializes");
            prop_assert_eq!(parse_strict(&bytes).expect("parses"), v);
        }

        /// Arbitrary bytes never panic the parser.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = parse_strict(&bytes);
        }
    }
}

//! Answer validation, failing closed: anything not exactly right is invalid.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecisionType {
    Confirm,
    Select,
    Input,
}

impl DecisionType {
    pub fn as_str(self) -> &'static str {
        match self {
            DecisionType::Confirm => "confirm",
            DecisionType::Select => "select",
            DecisionType::Input => "input",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "confirm" => Some(DecisionType::Confirm),
            "select" => Some(DecisionType::Select),
            "input" => Some(DecisionType::Input),
            _ => None,
        }
    }
}

impl fmt::Display for DecisionType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

pub const MAX_INPUT_CHARS: usize = 5000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// confirm `yes`: may be spent as a permit.
    Approved,
    /// confirm `no`.
    Denied,
    /// A valid select/input answer: data, never permission.
    Data,
    /// Anything else; the reason is for the operator.
    Invalid(String),
}

pub fn validate(kind: DecisionType, options: &[String], answer: &str) -> Verdict {
    match kind {
        DecisionType::Confirm => match answer {
            "yes" => Verdict::Approved,
            "no" => Verdict::Denied,
            _ => Verdict::Invalid("a confirm answer must be exactly `yes` or `no`".into()),
        },
        DecisionType::Select => {
            if options.iter().any(|o| o == answer) {
                Verdict::Data
            } else {
                Verdict::Invalid("the answer is not one of the offered options".into())
            }
        }
        DecisionType::Input => {
            let n = answer.chars().count();
            if n == 0 {
                Verdict::Invalid("an input answer must not be empty".into())
            } else if n > MAX_INPUT_CHARS {
                Verdict::Invalid(format!("an input answer must be at most {MAX_INPUT_CHARS} characters"))
            } else {
                Verdict::Data
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> Vec<String> {
        vec!["Zürich – Lager 2".into(), "Bern".into()]
    }

    #[test]
    fn confirm_accepts_exactly_yes_and_no() {
        assert_eq!(validate(DecisionType::Confirm, &[], "yes"), Verdict::Approved);
        assert_eq!(validate(DecisionType::Confirm, &[], "no"), Verdict::Denied);
        for bad in
            ["YES", " yes", "yes ", "Yes", "y", "true", "1", "", "no ", "NO", "ｙｅｓ", "yes\n", "yes\0"]
        {
            assert!(matches!(validate(DecisionType::Confirm, &[], bad), Verdict::Invalid(_)), "{bad:?}");
        }
    }

    #[test]
    fn select_needs_an_exact_option() {
        assert_eq!(validate(DecisionType::Select, &opts(), "Bern"), Verdict::Data);
        assert_eq!(validate(DecisionType::Select, &opts(), "Zürich – Lager 2"), Verdict::Data);
        for bad in ["bern", "Bern ", "Zu\u{308}rich – Lager 2", "", "yes"] {
            assert!(matches!(validate(DecisionType::Select, &opts(), bad), Verdict::Invalid(_)), "{bad:?}");
        }
        assert!(matches!(validate(DecisionType::Select, &[], "Bern"), Verdict::Invalid(_)));
    }

    #[test]
    fn input_is_one_to_five_thousand_characters() {
        assert_eq!(validate(DecisionType::Input, &[], "x"), Verdict::Data);
        assert_eq!(validate(DecisionType::Input, &[], &"ü".repeat(5000)), Verdict::Data);
        assert!(matches!(validate(DecisionType::Input, &[], ""), Verdict::Invalid(_)));
        assert!(matches!(validate(DecisionType::Input, &[], &"a".repeat(5001)), Verdict::Invalid(_)));
        // Data answers are never approvals, even when they read "yes".
        assert_eq!(validate(DecisionType::Input, &[], "yes"), Verdict::Data);
    }

    #[test]
    fn type_names_round_trip() {
        for t in [DecisionType::Confirm, DecisionType::Select, DecisionType::Input] {
            assert_eq!(DecisionType::parse(t.as_str()), Some(t));
        }
        assert_eq!(DecisionType::parse("Confirm"), None);
    }
}

#[cfg(test)]
mod properties {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// A confirm answer approves only as exactly `yes`, and is never
        /// data: so a confirm can reach an effect only through a permit.
        #[test]
        fn confirm_approves_only_exact_yes(answer in any::<String>()) {
            let v = validate(DecisionType::Confirm, &[], &answer);
            prop_assert_eq!(v == Verdict::Approved, answer == "yes");
            prop_assert_eq!(v == Verdict::Denied, answer == "no");
            prop_assert!(v != Verdict::Data);
        }

        #[test]
        fn select_and_input_are_never_approvals(
            options in prop::collection::vec(any::<String>(), 0..5),
            answer in any::<String>(),
        ) {
            let s = validate(DecisionType::Select, &options, &answer);
            prop_assert_eq!(s == Verdict::Data, options.contains(&answer));
            let i = validate(DecisionType::Input, &[], &answer);
            let n = answer.chars().count();
            prop_assert_eq!(i == Verdict::Data, (1..=MAX_INPUT_CHARS).contains(&n));
            prop_assert!(s != Verdict::Approved && i != Verdict::Approved);
        }
    }
}

//! The operation's lifecycle. Transitions go one way; terminal states are
//! left only by an operator resolving `uncertain`.

use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum State {
    Enqueued,
    Pending,
    Answered,
    Permitted,
    Delivering,
    Succeeded,
    Failed,
    Uncertain,
    Expired,
    Cancelled,
    Denied,
    Invalid,
    Refused,
    Unreachable,
}

use State::*;

impl State {
    pub const ALL: [State; 14] = [
        Enqueued,
        Pending,
        Answered,
        Permitted,
        Delivering,
        Succeeded,
        Failed,
        Uncertain,
        Expired,
        Cancelled,
        Denied,
        Invalid,
        Refused,
        Unreachable,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Enqueued => "enqueued",
            Pending => "pending",
            Answered => "answered",
            Permitted => "permitted",
            Delivering => "delivering",
            Succeeded => "succeeded",
            Failed => "failed",
            Uncertain => "uncertain",
            Expired => "expired",
            Cancelled => "cancelled",
            Denied => "denied",
            Invalid => "invalid",
            Refused => "refused",
            Unreachable => "unreachable",
        }
    }

    /// No worker moves an operation out of these. `uncertain` is terminal
    /// for workers; only an operator resolves it.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Succeeded | Failed | Uncertain | Expired | Cancelled | Denied | Invalid | Refused | Unreachable
        )
    }

    /// Still waiting for the human (or for the decision to be opened).
    pub fn is_open(self) -> bool {
        matches!(self, Enqueued | Pending)
    }

    /// The transitions a worker may make. Every path to `succeeded` through
    /// `permitted` passes a consumed permit; select/input answers go
    /// `answered → delivering` as data.
    pub fn can_become(self, to: State) -> bool {
        matches!(
            (self, to),
            (Enqueued, Pending | Unreachable | Cancelled | Expired)
                | (Pending, Answered | Expired | Cancelled)
                | (Answered, Permitted | Denied | Invalid | Refused | Delivering | Uncertain | Expired)
                | (Permitted, Delivering | Expired | Uncertain)
                | (Delivering, Succeeded | Failed | Uncertain)
        )
    }

    /// What an operator may do with an operation whose outcome is unknown.
    pub fn operator_can_resolve(self, to: State) -> bool {
        self == Uncertain && matches!(to, Succeeded | Failed)
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for State {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        State::ALL.into_iter().find(|st| st.as_str() == s).ok_or_else(|| format!("unknown state `{s}`"))
    }
}

/// What the effect target is told; API.md's `status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutcomeStatus {
    Approved,
    Denied,
    Answered,
    Expired,
    Cancelled,
    Invalid,
    Refused,
    Unreachable,
}

impl OutcomeStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            OutcomeStatus::Approved => "approved",
            OutcomeStatus::Denied => "denied",
            OutcomeStatus::Answered => "answered",
            OutcomeStatus::Expired => "expired",
            OutcomeStatus::Cancelled => "cancelled",
            OutcomeStatus::Invalid => "invalid",
            OutcomeStatus::Refused => "refused",
            OutcomeStatus::Unreachable => "unreachable",
        }
    }

    /// The rejection an operation in `state` is delivered as, if it is one.
    pub fn rejection_for(state: State) -> Option<Self> {
        Some(match state {
            Denied => OutcomeStatus::Denied,
            Expired => OutcomeStatus::Expired,
            Cancelled => OutcomeStatus::Cancelled,
            Invalid => OutcomeStatus::Invalid,
            Refused => OutcomeStatus::Refused,
            Unreachable => OutcomeStatus::Unreachable,
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for s in State::ALL {
            assert_eq!(s.as_str().parse::<State>(), Ok(s));
        }
        assert!("nope".parse::<State>().is_err());
    }

    #[test]
    fn no_transition_leaves_a_terminal_state() {
        for from in State::ALL.into_iter().filter(|s| s.is_terminal()) {
            for to in State::ALL {
                assert!(!from.can_become(to), "{from} -> {to}");
            }
        }
    }

    #[test]
    fn no_transition_goes_back_to_an_open_state_or_to_itself() {
        for from in State::ALL {
            assert!(!from.can_become(Enqueued));
            assert!(!from.can_become(from));
            if from != Enqueued {
                assert!(!from.can_become(Pending));
            }
        }
    }

    /// Enumerates every path from `enqueued`; a path reaching `succeeded`
    /// either passed `permitted` (a consumed permit) or went
    /// `answered → delivering` directly, which the worker allows only for
    /// data answers (select/input).
    #[test]
    fn every_path_to_succeeded_passes_answered() {
        fn walk(path: &mut Vec<State>, out: &mut Vec<Vec<State>>) {
            let last = *path.last().expect("non-empty");
            if last == Succeeded {
                out.push(path.clone());
                return;
            }
            for next in State::ALL {
                if last.can_become(next) && !path.contains(&next) {
                    path.push(next);
                    walk(path, out);
                    path.pop();
                }
            }
        }
        let mut paths = Vec::new();
        walk(&mut vec![Enqueued], &mut paths);
        assert_eq!(paths.len(), 2);
        for p in &paths {
            assert!(p.contains(&Pending) && p.contains(&Answered) && p.contains(&Delivering), "{p:?}");
        }
    }

    #[test]
    fn rejections_are_the_fail_closed_states() {
        for s in State::ALL {
            let r = OutcomeStatus::rejection_for(s);
            assert_eq!(r.is_some(), s.is_terminal() && !matches!(s, Succeeded | Failed | Uncertain), "{s}");
        }
    }

    #[test]
    fn only_uncertain_is_resolvable() {
        for from in State::ALL {
            for to in State::ALL {
                let ok = from.operator_can_resolve(to);
                assert_eq!(ok, from == Uncertain && (to == Succeeded || to == Failed));
            }
        }
    }
}

#[cfg(test)]
mod properties {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Random walks through the table: nothing leaves a terminal state,
        /// and reaching `succeeded` always went through an answer and a delivery.
        #[test]
        fn random_walks_respect_the_table(steps in prop::collection::vec(0..State::ALL.len(), 0..60)) {
            let mut state = Enqueued;
            let mut path = vec![state];
            for i in steps {
                let to = State::ALL[i];
                if state.is_terminal() {
                    prop_assert!(!state.can_become(to));
                    continue;
                }
                if state.can_become(to) {
                    state = to;
                    path.push(state);
                }
            }
            if state == Succeeded {
                prop_assert!(path.contains(&Answered) && path.contains(&Delivering), "{:?}", path);
            }
        }
    }
}

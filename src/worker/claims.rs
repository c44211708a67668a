//! The threads this process's workers are on, and what came for each while
//! it was held.
//!
//! The store's lease decides who works a thread; these claims only spare
//! the store the attempts a sibling would lose. They also close the gap
//! left since a worker stopped reading the store for work after every
//! visit (docs/decisions.md §33): work that came for a thread after its
//! holder's last read of it, while the holder still had it. Such work
//! reached the workers one of two ways, and each is answered when the
//! holder lets the thread go:
//!
//! - the thread was named to a worker (an offer), who found it held: the
//!   holder names it again;
//! - the store was read for work after the holder's last read of the
//!   thread began, on a store whose leases hide held threads from that
//!   read (PostgreSQL): the holder has the store read again. Work that
//!   woke that read was committed before it began; a last read begun
//!   after it sees that work itself.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// (tenant, thread id).
pub(crate) type ThreadKey = (String, String);

/// What a worker must do for a thread it lets go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Missed {
    /// Nothing came for the thread that its holder's last read missed.
    Nothing,
    /// The thread was named to a worker who found it held: name it again.
    /// (One look at the thread also answers a read it was hidden from.)
    Offered,
    /// The store was read for work after the holder's last read of the
    /// thread began, and the thread's lease hid it: read the store again.
    HiddenFromRead,
}

#[derive(Debug)]
struct Held {
    offered: bool,
    /// `Inner::reads` when the holder's latest read of the thread began.
    read_from: u64,
    /// Held by the inbox for an applied answer, not by a worker.
    reserved: Option<Reserved>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reserved {
    /// The answer's save is being made: no worker may take the thread.
    Applying,
    /// The answer is handed on: the next worker to take the thread goes
    /// on from it, holding the claim from the save on.
    Ready,
}

#[derive(Debug, Default)]
struct Inner {
    held: HashMap<ThreadKey, Held>,
    /// Reads of the store for work that held threads were hidden from.
    reads: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Claims {
    inner: Mutex<Inner>,
}

impl Claims {
    fn inner(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Claims the thread for a worker, whose first read of it begins now;
    /// or notes that it was named to one while another held it.
    pub(crate) fn take(&self, key: ThreadKey) -> Option<Claim<'_>> {
        let mut inner = self.inner();
        let read_from = inner.reads;
        if let Some(held) = inner.held.get_mut(&key) {
            if held.reserved == Some(Reserved::Ready) {
                held.reserved = None;
                held.read_from = read_from;
                return Some(Claim { claims: self, key: Some(key) });
            }
            held.offered = true;
            return None;
        }
        inner.held.insert(key.clone(), Held { offered: false, read_from, reserved: None });
        Some(Claim { claims: self, key: Some(key) })
    }

    /// Holds a free thread for an answer the inbox is applying (SQLite):
    /// false if a worker, or another such answer, has it.
    pub(crate) fn reserve(&self, key: &ThreadKey) -> bool {
        let mut inner = self.inner();
        if inner.held.contains_key(key) {
            return false;
        }
        let read_from = inner.reads;
        inner
            .held
            .insert(key.clone(), Held { offered: false, read_from, reserved: Some(Reserved::Applying) });
        true
    }

    /// The reserved thread's answer is handed on: the next `take` of it
    /// takes the claim over.
    pub(crate) fn hand_over(&self, key: &ThreadKey) {
        if let Some(held) = self.inner().held.get_mut(key)
            && held.reserved == Some(Reserved::Applying)
        {
            held.reserved = Some(Reserved::Ready);
        }
    }

    /// Frees a thread reserved and not taken over (its answer's save was
    /// not made, or no visit will come): whether it was named to a worker
    /// meanwhile, who then passed it by.
    pub(crate) fn unreserve(&self, key: &ThreadKey) -> Missed {
        let mut inner = self.inner();
        match inner.held.get(key) {
            Some(held) if held.reserved.is_some() => {
                let offered = held.offered;
                inner.held.remove(key);
                if offered { Missed::Offered } else { Missed::Nothing }
            }
            _ => Missed::Nothing,
        }
    }

    /// How many threads are held.
    pub(crate) fn busy(&self) -> usize {
        self.inner().held.len()
    }

    /// A read of the store for work is about to begin, and the leases of
    /// the threads held now hide them from it.
    pub(crate) fn hidden_from_read(&self) {
        self.inner().reads += 1;
    }
}

/// A worker's hold on a thread. `release` says what came for it meanwhile;
/// dropped unreleased (a visit that found the thread leased elsewhere, or
/// was cancelled at shutdown) it just lets go.
#[derive(Debug)]
pub(crate) struct Claim<'a> {
    claims: &'a Claims,
    key: Option<ThreadKey>,
}

impl Claim<'_> {
    pub(crate) fn key(&self) -> &ThreadKey {
        self.key.as_ref().expect("a claim holds its key until released")
    }

    /// The holder begins another read of the thread's work.
    pub(crate) fn reading(&self) {
        let mut inner = self.claims.inner();
        let reads = inner.reads;
        if let Some(held) = inner.held.get_mut(self.key()) {
            held.read_from = reads;
        }
    }

    /// Lets the thread go: what came for it that the holder's last read
    /// may have missed.
    pub(crate) fn release(mut self) -> (ThreadKey, Missed) {
        let key = self.key.take().expect("a claim is released once");
        let mut inner = self.claims.inner();
        let reads = inner.reads;
        let missed = match inner.held.remove(&key) {
            Some(Held { offered: true, .. }) => Missed::Offered,
            Some(Held { read_from, .. }) if read_from < reads => Missed::HiddenFromRead,
            _ => Missed::Nothing,
        };
        (key, missed)
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.claims.inner().held.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(thread: &str) -> ThreadKey {
        ("acme".to_owned(), thread.to_owned())
    }

    #[test]
    fn a_thread_is_held_once_and_free_again_when_released() {
        let claims = Claims::default();
        let first = claims.take(key("t1")).expect("free");
        assert!(claims.take(key("t1")).is_none(), "held");
        let other = claims.take(key("t2")).expect("another thread is free");
        assert_eq!(claims.busy(), 2);
        assert_eq!(first.release().0, key("t1"));
        assert_eq!(claims.busy(), 1);
        assert!(claims.take(key("t1")).is_some(), "free again");
        drop(other);
    }

    #[test]
    fn nothing_missed_when_nothing_came() {
        let claims = Claims::default();
        let claim = claims.take(key("t1")).expect("free");
        claim.reading();
        assert_eq!(claim.release(), (key("t1"), Missed::Nothing));
    }

    #[test]
    fn a_thread_named_while_held_is_named_again() {
        let claims = Claims::default();
        let claim = claims.take(key("t1")).expect("free");
        assert!(claims.take(key("t1")).is_none());
        assert!(claims.take(key("t1")).is_none(), "named twice: still one ask");
        claim.reading();
        assert_eq!(claim.release(), (key("t1"), Missed::Offered), "a later read does not clear a name");
    }

    #[test]
    fn a_store_read_begun_after_the_holders_last_read_asks_for_another() {
        let claims = Claims::default();
        let (a, b) = (claims.take(key("a")).expect("free"), claims.take(key("b")).expect("free"));
        claims.hidden_from_read();
        let c = claims.take(key("c")).expect("taken after the read began");
        assert_eq!(a.release().1, Missed::HiddenFromRead);
        b.reading();
        assert_eq!(b.release().1, Missed::Nothing, "its last read began after the store's");
        assert_eq!(c.release().1, Missed::Nothing, "its first read began after the store's");
    }

    #[test]
    fn every_store_read_counts() {
        let claims = Claims::default();
        let a = claims.take(key("a")).expect("free");
        claims.hidden_from_read();
        a.reading();
        claims.hidden_from_read();
        assert_eq!(a.release().1, Missed::HiddenFromRead, "the second read began after its last");
    }

    #[test]
    fn named_and_hidden_is_named() {
        for named_first in [true, false] {
            let claims = Claims::default();
            let claim = claims.take(key("t1")).expect("free");
            if named_first {
                assert!(claims.take(key("t1")).is_none());
                claims.hidden_from_read();
            } else {
                claims.hidden_from_read();
                assert!(claims.take(key("t1")).is_none());
            }
            assert_eq!(claim.release().1, Missed::Offered, "named first: {named_first}");
        }
    }

    #[test]
    fn dropped_unreleased_lets_go_and_forgets_what_came() {
        let claims = Claims::default();
        let claim = claims.take(key("t1")).expect("free");
        assert!(claims.take(key("t1")).is_none());
        claims.hidden_from_read();
        drop(claim);
        assert_eq!(claims.busy(), 0);
        let again = claims.take(key("t1")).expect("free after the drop");
        assert_eq!(again.release().1, Missed::Nothing, "the old asks went with the old claim");
    }

    // The inbox's hold on a thread (SQLite): no worker takes it while the
    // answer is being applied; once handed on, the next take goes on
    // holding it, and a name given meanwhile is not lost.
    #[test]
    fn a_reserved_thread_is_taken_over_only_once_handed_on() {
        let claims = Claims::default();
        let worker = claims.take(key("busy")).expect("free");
        assert!(!claims.reserve(&key("busy")), "a worker has it");
        assert!(claims.reserve(&key("t1")));
        assert!(!claims.reserve(&key("t1")), "reserved once");
        assert!(claims.take(key("t1")).is_none(), "not while the answer is applied");
        claims.hand_over(&key("t1"));
        let claim = claims.take(key("t1")).expect("taken over");
        assert!(claims.take(key("t1")).is_none(), "held by its new holder");
        assert_eq!(claims.unreserve(&key("t1")), Missed::Nothing, "a worker's claim is not a reservation");
        assert_eq!(claims.busy(), 2);
        assert_eq!(claim.release(), (key("t1"), Missed::Offered), "named while applied and while held");
        drop(worker);
        assert_eq!(claims.busy(), 0);
    }

    #[test]
    fn an_unreserved_thread_is_free_and_says_if_it_was_named() {
        let claims = Claims::default();
        assert!(claims.reserve(&key("t1")));
        assert_eq!(claims.unreserve(&key("t1")), Missed::Nothing);
        assert!(claims.reserve(&key("t1")), "free again");
        assert!(claims.take(key("t1")).is_none());
        claims.hand_over(&key("t1"));
        assert_eq!(claims.unreserve(&key("t1")), Missed::Offered, "handed on, then let go unvisited");
        assert!(claims.take(key("t1")).is_some(), "free again");
    }

    #[test]
    fn releases_of_other_threads_keep_their_own_asks() {
        let claims = Claims::default();
        let (a, b) = (claims.take(key("a")).expect("free"), claims.take(key("b")).expect("free"));
        assert!(claims.take(key("b")).is_none());
        assert_eq!(a.release().1, Missed::Nothing);
        assert_eq!(b.release().1, Missed::Offered);
    }
}

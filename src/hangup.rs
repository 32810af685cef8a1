//! Whether the client of a request is still there to hear its answer: a leaf of the module
//! graph, so that the lock code (the `optimistic` attempt) can look too.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Whether the client of a sale is still there to hear its answer. The HTTP handler holds a
/// [`HangupGuard`]: dropped with the handler's future (the client closed its connection, or
/// nginx closed its own after the client left), it marks the sale's client gone. The sale
/// itself runs in a task of its own and is never cut short mid-way: it looks at this only
/// where stopping is clean, once it holds the lock and before it writes, and then sells
/// nothing. A sale nobody waits for would sell stock to nobody (each buyer left, 504 in
/// hand, and may buy again), and queued sales of clients long gone kept selling for the
/// whole wait budget after them.
#[derive(Debug, Clone, Default)]
pub struct Hangup(Option<Arc<AtomicBool>>);

impl Hangup {
    /// A client that never goes away (a sale run from code, not from a request).
    pub fn never() -> Self {
        Self(None)
    }

    /// A hangup to give the sale, and the guard whose drop raises it.
    pub fn watch() -> (Self, HangupGuard) {
        let flag = Arc::new(AtomicBool::new(false));
        (Self(Some(flag.clone())), HangupGuard(flag))
    }

    pub fn is_gone(&self) -> bool {
        self.0.as_ref().is_some_and(|f| f.load(Ordering::Relaxed))
    }
}

/// Held by the request: its drop tells the sale that nobody waits for its answer.
pub struct HangupGuard(Arc<AtomicBool>);

impl Drop for HangupGuard {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

//! The events of a sale that the service logs for tools to read, defined once: the log sites
//! write `event = Event::StockRead.name()`, and the fault scenarios' timeline
//! (`loadtest::timeline`) reads the same field back with [`Event::from_name`]. Renaming a
//! variant breaks every use at compile time; changing a name changes writer and reader
//! together. A log line's message stays free text for people.
//!
//! A leaf: it uses nothing of this crate.

/// The JSON log field that carries an event's [`name`](Event::name). The log sites spell it
/// as the macro's key, `event = ...`, which cannot be a constant.
pub const FIELD: &str = "event";

/// One step of a sale that the timeline shows and the fault scenarios wait for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Event {
    /// A lock taken, or re-entered (`nested`); with `owner`, `fence`, `waited_ms`.
    LockAcquired,
    /// A release, with what it found (`released`: `Freed`, `StillHeld`, `NotHeld`).
    LockReleased,
    /// A lease renewed by the watchdog.
    LockRenewed,
    /// The holder learnt that its lock is gone (`reason`).
    LockLost,
    /// The stock read under the lock (`stock`, `fence`).
    StockRead,
    /// The stock written (`remaining`, `fence`).
    SaleWritten,
    /// The write refused (`reason`: `lock_lost`, `stale_fence`, ...).
    SaleRefused,
    /// One quorum acquire's count (`redlock`): `votes`, one word per node in `LOCK_NODES`'
    /// order (`granted`, `busy`, `failed`), `granted`, `nodes` and whether it is `held`.
    LockQuorum,
    /// An optimistic sale's `EXEC` refused because a watched key changed (`attempt`): its
    /// work is thrown away and it tries again.
    TransactionConflict,
}

impl Event {
    pub const ALL: [Event; 9] = [
        Event::LockAcquired,
        Event::LockReleased,
        Event::LockRenewed,
        Event::LockLost,
        Event::StockRead,
        Event::SaleWritten,
        Event::SaleRefused,
        Event::LockQuorum,
        Event::TransactionConflict,
    ];

    /// Its value in the [`FIELD`] of a log line.
    pub const fn name(self) -> &'static str {
        match self {
            Event::LockAcquired => "lock acquired",
            Event::LockReleased => "lock released",
            Event::LockRenewed => "lock renewed",
            Event::LockLost => "lock lost",
            Event::StockRead => "stock read",
            Event::SaleWritten => "sale written",
            Event::SaleRefused => "sale refused",
            Event::LockQuorum => "lock quorum",
            Event::TransactionConflict => "transaction conflict",
        }
    }

    /// The event a log line's [`FIELD`] names, if any.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|e| e.name() == name)
    }
}

impl std::fmt::Display for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_is_distinct_and_read_back() {
        for event in Event::ALL {
            assert_eq!(Event::from_name(event.name()), Some(event));
        }
        assert_eq!(Event::from_name("nothing"), None);
    }
}

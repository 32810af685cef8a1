//! `local` (tutorial v1/v2): a mutex inside the process around read, work and write.
//! Fixes: `none`'s lost updates as long as there is a single instance.
//! Still wrong: the mutex is invisible to the other instance behind nginx, so two instances
//! sell the same item (the tutorial's "76 sold twice"); and it is not reentrant.

use std::sync::Arc;

use tokio::sync::{Mutex, OwnedMutexGuard};
use tokio::time::Instant;

/// A tokio mutex, not a std one: the guard is held across the awaits of the sale.
/// `None` when the deadline passed first.
pub(super) async fn acquire(
    mutex: &Arc<Mutex<()>>,
    deadline: Instant,
) -> Option<OwnedMutexGuard<()>> {
    tokio::time::timeout_at(deadline, mutex.clone().lock_owned())
        .await
        .ok()
}

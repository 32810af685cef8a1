//! The `atomic` sales of one item that reach an instance together go to Redis together: one
//! `sell.lua` call sells them all, in the order they came, as far as the stock goes (a group
//! commit). Each still gets its own ledger entry, audit bit and remaining value; what they
//! share is Redis's cost of a call (reading and parsing the command, setting up the script,
//! its counters, the reply), which was about half of Redis's CPU per sale: sold one call
//! each, 12.5-13.6 µs of Redis's CPU a sale; six a call, 7.3-8.4 (`redis-benchmark`, two
//! clients).
//!
//! A sale joins the batch now forming; the first to join spawns the task that sends it.
//! On the single-threaded scheduler a spawned task runs after the tasks already woken, so
//! the batch holds every sale read from the connections that were ready in the same turn,
//! and none waits for a later one: a sale alone is sent at once. The multi-threaded
//! scheduler runs a spawned task next, on the same worker (its LIFO slot), so a batch
//! there would be one sale plus a spawn; its sales are sent one call each, as before.
//!
//! What a sale's client sees does not change: a client that hangs up before the batch is
//! sent sells nothing (its place is dropped); once sent, the sale lands or not with the
//! others, and a call whose answer never came is an unknown outcome for each of them.

use std::sync::Mutex;

use redis::{RedisError, RedisResult};
use tokio::sync::oneshot;

use super::Recorded;

/// Sales in one call at most: the script runs its writes for all of them while Redis
/// serves nobody else, and 32 sales is about 50 µs of it.
pub(super) const MOST: usize = 32;

/// The atomic sales of one item waiting for their call.
#[derive(Default)]
pub(super) struct Batch {
    forming: Mutex<Forming>,
}

#[derive(Default)]
struct Forming {
    sales: Vec<Waiting>,
    /// A task is on its way to send `sales`.
    sending: bool,
}

pub(super) struct Waiting {
    /// The sale's ledger head ([`super::Entry::head`]).
    pub head: String,
    answer: oneshot::Sender<RedisResult<Recorded>>,
}

impl Batch {
    /// Adds a sale to the batch forming; `true` when the caller must spawn the task that
    /// sends it (nobody was on the way).
    pub fn join(&self, head: String) -> (bool, oneshot::Receiver<RedisResult<Recorded>>) {
        let (answer, answered) = oneshot::channel();
        // A std mutex: no await happens while it is held.
        let mut forming = self.forming.lock().unwrap_or_else(|p| p.into_inner());
        forming.sales.push(Waiting { head, answer });
        let first = !std::mem::replace(&mut forming.sending, true);
        (first, answered)
    }

    /// The sales to send now, in calls of at most [`MOST`]; the next sale to join starts a
    /// new batch. A sale whose client has gone is left out: nothing was sent for it.
    pub fn take(&self) -> Vec<Vec<Waiting>> {
        let sales = {
            let mut forming = self.forming.lock().unwrap_or_else(|p| p.into_inner());
            forming.sending = false;
            std::mem::take(&mut forming.sales)
        };
        let mut calls: Vec<Vec<Waiting>> = Vec::new();
        for sale in sales.into_iter().filter(|s| !s.answer.is_closed()) {
            match calls.last_mut() {
                Some(call) if call.len() < MOST => call.push(sale),
                _ => calls.push(vec![sale]),
            }
        }
        calls
    }
}

/// The heads of a call's sales, a line each, as `sell.lua` reads them.
pub(super) fn heads(call: &[Waiting]) -> String {
    let mut heads = String::with_capacity(call.iter().map(|s| s.head.len() + 1).sum());
    for (i, sale) in call.iter().enumerate() {
        if i > 0 {
            heads.push('\n');
        }
        heads.push_str(&sale.head);
    }
    heads
}

/// Tells each sale of a call what it got.
pub(super) fn answer(call: Vec<Waiting>, outcome: RedisResult<Recorded>) {
    for (i, sale) in call.into_iter().enumerate() {
        // A client gone since the call was sent hears nothing; its sale counts all the same.
        let _ = sale.answer.send(outcome.clone().map(|r| r.nth(i)));
    }
}

/// What a sale hears when the task sending its batch ended without answering it (it
/// panicked): the call may have been sent, so its outcome is unknown, never "not sold".
pub(super) fn unanswered() -> RedisError {
    RedisError::from(std::io::Error::other(
        "the call carrying this sale ended without an answer",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_sale_to_join_sends_the_batch_and_the_next_one_after_a_take_starts_another() {
        let batch = Batch::default();
        let (first, _a) = batch.join("a".into());
        let (second, _b) = batch.join("b".into());
        assert!(first && !second);
        let calls = batch.take();
        assert_eq!(calls.len(), 1);
        assert_eq!(heads(&calls[0]), "a\nb");
        let (third, _c) = batch.join("c".into());
        assert!(
            third,
            "a take ends the batch: the next sale must send its own"
        );
    }

    #[test]
    fn a_sale_whose_client_has_gone_is_not_sent() {
        let batch = Batch::default();
        let (_, kept) = batch.join("kept".into());
        let (_, gone) = batch.join("gone".into());
        drop(gone);
        let calls = batch.take();
        assert_eq!(calls.iter().map(|c| heads(c)).collect::<Vec<_>>(), ["kept"]);
        drop(kept);
    }

    #[test]
    fn calls_hold_at_most_most_sales_in_the_order_they_joined() {
        let batch = Batch::default();
        let receivers: Vec<_> = (0..MOST + 3).map(|i| batch.join(i.to_string()).1).collect();
        let calls = batch.take();
        assert_eq!(calls.iter().map(Vec::len).collect::<Vec<_>>(), [MOST, 3]);
        let order: Vec<String> = calls.iter().flatten().map(|s| s.head.clone()).collect();
        let expected: Vec<String> = (0..MOST + 3).map(|i| i.to_string()).collect();
        assert_eq!(order, expected);
        drop(receivers);
    }

    #[test]
    fn each_sale_of_a_call_gets_its_own_remaining_value_while_stock_lasts() {
        let batch = Batch::default();
        let mut receivers: Vec<_> = (0..4).map(|i| batch.join(i.to_string()).1).collect();
        let call = batch.take().remove(0);
        // Two left when the call ran: the first two sold, 1 and 0 left; the others found none.
        answer(call, Ok(Recorded::Written(1)));
        let got: Vec<Recorded> = receivers
            .iter_mut()
            .map(|r| r.try_recv().expect("answered").expect("no error"))
            .collect();
        assert_eq!(
            got,
            [
                Recorded::Written(1),
                Recorded::Written(0),
                Recorded::SoldOut,
                Recorded::SoldOut
            ]
        );
    }

    #[test]
    fn an_error_reaches_every_sale_of_the_call() {
        let batch = Batch::default();
        let mut receivers: Vec<_> = (0..3).map(|i| batch.join(i.to_string()).1).collect();
        let call = batch.take().remove(0);
        answer(call, Err(unanswered()));
        for r in &mut receivers {
            assert!(r.try_recv().expect("answered").is_err());
        }
    }
}

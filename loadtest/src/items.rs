//! `--items N`: the sales of one run spread over N items of their own, each judged by its own
//! audit. One item is the default item on the paths without an id, as before `--items`.
//!
//! Items are handed out in shuffled rounds: every round of N requests visits each item once,
//! in a fresh random order. Round-robin's fairness (each item gets `requests / N` requests,
//! give or take one, so `--requests N * stock` or more sells every item out and the items'
//! figures compare) without its lockstep: nginx alternates the instances request by request,
//! so with a fixed order and an even N an item could go mostly to one instance, and `local`
//! (one mutex per instance) would look safe. Uniform random draws break the lockstep too, but
//! leave some items short of their stock in a `--requests` run.

use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use inventory::store::Audit;
use serde::{Deserialize, Serialize};

use crate::Verdict;

/// Most items one run spreads its sales over: each is reset and audited with a request of
/// its own before and after every strategy, and drawn as a bar of the report.
pub const MAX_ITEMS: usize = 10_000;

/// The id of item `n` (1-based) of a run over `count` items: `item-0001`, `item-0002`, ...,
/// zero-padded to four digits, or to as many as `count` has (`item-10000`).
pub fn item_id(n: usize, count: usize) -> String {
    let width = count.to_string().len().max(4);
    format!("item-{n:0width$}")
}

/// Checks `--items`, in the words of its refusal.
pub fn check_count(items: usize) -> anyhow::Result<()> {
    anyhow::ensure!(
        (1..=MAX_ITEMS).contains(&items),
        "--items must be between 1 and {MAX_ITEMS}, not {items}"
    );
    Ok(())
}

/// What one item came to: the clients' counts against the item's own audit.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ItemReport {
    /// The item's id, as its audit names it (the service's `ITEM_ID` for the default item).
    pub id: String,
    /// Requests sent for this item.
    pub requests: u64,
    /// 200 answers.
    pub sold: u64,
    /// Requests that ended in neither a sale nor a refusal (they may have sold unseen).
    pub errors: u64,
    /// Sales the item's ledger recorded.
    pub audit_sales: i64,
    /// Stock left, from the item's audit.
    pub remaining: i64,
    /// From the item's audit: max(0, sales - initial).
    pub oversold: i64,
    /// From the item's audit: sales - (initial - remaining).
    pub lost_updates: i64,
    /// From the item's audit: remaining-stock values sold more than once.
    pub duplicates: u64,
    /// Sales answered 200 that the item's ledger has no record of.
    pub lost_200: i64,
    /// Whether the clients' 200s for this item match its ledger.
    pub agrees: bool,
    /// Why they do not, when they do not.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub disagreement: Option<String>,
    /// `OVERSOLD` when the audit shows any oversell, lost update or duplicate, or a 200 the
    /// ledger lost.
    pub verdict: Verdict,
}

/// The clients' side of one item.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    pub requests: u64,
    pub sold: u64,
    pub errors: u64,
}

impl ItemReport {
    /// Holds what the clients saw of one item against that item's audit.
    pub fn judge(tally: Tally, audit: &Audit) -> Self {
        let lost_200 = (tally.sold as i64 - audit.sales).max(0);
        // A sale answered 200 and lost sells its item again: an oversell the audit cannot see.
        let verdict = if audit.oversold > 0
            || audit.lost_updates != 0
            || !audit.duplicates.is_empty()
            || lost_200 > 0
        {
            Verdict::Oversold
        } else {
            Verdict::Safe
        };
        let disagreement = crate::disagreement(tally.sold, tally.errors, audit.sales);
        ItemReport {
            id: audit.item.clone(),
            requests: tally.requests,
            sold: tally.sold,
            errors: tally.errors,
            audit_sales: audit.sales,
            remaining: audit.remaining,
            oversold: audit.oversold,
            lost_updates: audit.lost_updates,
            duplicates: audit.duplicates.len() as u64,
            lost_200,
            agrees: disagreement.is_none(),
            disagreement,
            verdict,
        }
    }
}

/// The items' figures in one line's worth: the fewest and most sold per item, and which
/// items were oversold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spread {
    pub items: usize,
    pub min_sold: u64,
    pub max_sold: u64,
    pub oversold: Vec<String>,
}

impl Spread {
    pub fn of(items: &[ItemReport]) -> Self {
        Spread {
            items: items.len(),
            min_sold: items.iter().map(|i| i.sold).min().unwrap_or(0),
            max_sold: items.iter().map(|i| i.sold).max().unwrap_or(0),
            oversold: items
                .iter()
                .filter(|i| i.verdict == Verdict::Oversold)
                .map(|i| i.id.clone())
                .collect(),
        }
    }
}

/// At most `shown` ids, then how many more: a line stays a line with 10000 items.
pub fn name_some(ids: &[String], shown: usize) -> String {
    let mut text = ids
        .iter()
        .take(shown)
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(", ");
    if ids.len() > shown {
        text.push_str(&format!(" and {} more", ids.len() - shown));
    }
    text
}

/// Hands out item indices in shuffled rounds (see the module's comment).
pub(crate) struct Deck {
    items: usize,
    /// The rest of this round, drawn from the back, and the generator's state. A std
    /// `Mutex`: it is held for a pop or a shuffle, never across an await.
    round: Mutex<(Vec<usize>, u64)>,
}

impl Deck {
    pub(crate) fn new(items: usize) -> Self {
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0x5eed, |d| d.as_nanos() as u64);
        Self::seeded(items, seed)
    }

    pub(crate) fn seeded(items: usize, seed: u64) -> Self {
        Deck {
            items,
            round: Mutex::new((Vec::with_capacity(items), seed)),
        }
    }

    pub(crate) fn draw(&self) -> usize {
        if self.items <= 1 {
            return 0;
        }
        // A poisoned lock only means another worker panicked mid-draw; the deck is still a
        // deck.
        let mut guard = self.round.lock().unwrap_or_else(|e| e.into_inner());
        let (round, state) = &mut *guard;
        if round.is_empty() {
            round.extend(0..self.items);
            // Fisher-Yates with splitmix64: a dependency-free generator is plenty for
            // spreading requests.
            for i in (1..round.len()).rev() {
                let j = (splitmix64(state) % (i as u64 + 1)) as usize;
                round.swap(i, j);
            }
        }
        round.pop().unwrap_or(0)
    }
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use inventory::store::Duplicate;

    /// An audit of `item` as the server would compute it (shared with `lib.rs`'s tests).
    pub(crate) fn audit(item: &str, initial: i64, sales: i64, remaining: i64) -> Audit {
        Audit {
            item: item.into(),
            initial,
            remaining,
            sales,
            oversold: (sales - initial).max(0),
            lost_updates: sales - (initial - remaining),
            duplicates: Vec::new(),
            clean: sales <= initial && sales == initial - remaining,
        }
    }

    fn tally(requests: u64, sold: u64, errors: u64) -> Tally {
        Tally {
            requests,
            sold,
            errors,
        }
    }

    #[test]
    fn item_ids_are_zero_padded_to_four_digits_or_to_the_count() {
        assert_eq!(item_id(1, 8), "item-0001");
        assert_eq!(item_id(8, 8), "item-0008");
        assert_eq!(item_id(10_000, MAX_ITEMS), "item-10000");
        assert_eq!(item_id(7, MAX_ITEMS), "item-00007");
        for n in [1, 10, MAX_ITEMS] {
            let id = item_id(n, MAX_ITEMS);
            assert_eq!(inventory::names::parse_item_id(&id).as_deref(), Ok(&*id));
        }
    }

    #[test]
    fn an_item_count_outside_one_to_the_maximum_is_refused_naming_the_range() {
        assert!(check_count(1).is_ok() && check_count(MAX_ITEMS).is_ok());
        for bad in [0, MAX_ITEMS + 1, usize::MAX] {
            let refusal = check_count(bad).unwrap_err().to_string();
            assert!(refusal.contains("between 1 and 10000"), "{refusal}");
        }
    }

    #[test]
    fn a_clean_item_whose_sales_all_reached_the_clients_is_safe_and_agrees() {
        let item = ItemReport::judge(tally(12, 5, 0), &audit("item-0001", 5, 5, 0));
        assert_eq!(item.verdict, Verdict::Safe);
        assert!(item.agrees && item.disagreement.is_none());
        assert_eq!(
            (item.id.as_str(), item.requests, item.sold, item.audit_sales),
            ("item-0001", 12, 5, 5)
        );
        assert_eq!((item.oversold, item.lost_updates, item.lost_200), (0, 0, 0));
    }

    #[test]
    fn each_kind_of_harm_in_an_items_audit_makes_it_oversold() {
        let oversold = ItemReport::judge(tally(20, 7, 0), &audit("a", 5, 7, 0));
        assert_eq!(
            (oversold.verdict, oversold.oversold),
            (Verdict::Oversold, 2)
        );
        let lost = ItemReport::judge(tally(20, 5, 0), &audit("b", 5, 5, 1));
        assert_eq!((lost.verdict, lost.lost_updates), (Verdict::Oversold, 1));
        let mut twice = audit("c", 5, 2, 3);
        twice.duplicates.push(Duplicate {
            remaining: 4,
            times: 2,
        });
        let dup = ItemReport::judge(tally(2, 2, 0), &twice);
        assert_eq!((dup.verdict, dup.duplicates), (Verdict::Oversold, 1));
        // Three 200s, two in the ledger: a failover lost one, and its stock sells again.
        let lost_200 = ItemReport::judge(tally(3, 3, 0), &audit("d", 5, 2, 3));
        assert_eq!(
            (lost_200.verdict, lost_200.lost_200),
            (Verdict::Oversold, 1)
        );
        assert!(!lost_200.agrees);
    }

    #[test]
    fn an_item_whose_ledger_has_more_than_the_clients_saw_says_why() {
        let item = ItemReport::judge(tally(10, 3, 2), &audit("e", 5, 4, 1));
        assert_eq!(item.verdict, Verdict::Safe);
        assert!(!item.agrees);
        let why = item.disagreement.unwrap();
        assert!(
            why.contains("recorded 4") && why.contains("may have gone unseen"),
            "{why}"
        );
    }

    #[test]
    fn the_spread_gives_the_fewest_and_most_sold_and_names_the_oversold_items() {
        let items = [
            ItemReport::judge(tally(20, 5, 0), &audit("item-0001", 5, 5, 0)),
            ItemReport::judge(tally(20, 8, 0), &audit("item-0002", 5, 8, 0)),
            ItemReport::judge(tally(20, 4, 0), &audit("item-0003", 5, 4, 1)),
            ItemReport::judge(tally(20, 6, 0), &audit("item-0004", 5, 6, 0)),
        ];
        let spread = Spread::of(&items);
        assert_eq!((spread.items, spread.min_sold, spread.max_sold), (4, 4, 8));
        assert_eq!(spread.oversold, ["item-0002", "item-0004"]);
        assert_eq!(Spread::of(&[]).oversold, Vec::<String>::new());
    }

    #[test]
    fn long_lists_of_ids_are_cut_with_a_count_of_the_rest() {
        let ids: Vec<String> = (1..=12).map(|n| item_id(n, 12)).collect();
        assert_eq!(name_some(&ids[..2], 10), "item-0001, item-0002");
        assert_eq!(
            name_some(&ids, 3),
            "item-0001, item-0002, item-0003 and 9 more"
        );
    }

    #[test]
    fn every_round_of_the_deck_visits_each_item_once_in_a_changing_order() {
        let deck = Deck::seeded(8, 42);
        let rounds: Vec<Vec<usize>> = (0..4)
            .map(|_| (0..8).map(|_| deck.draw()).collect())
            .collect();
        for round in &rounds {
            let mut sorted = round.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..8).collect::<Vec<_>>(), "{rounds:?}");
        }
        assert!(
            rounds.windows(2).any(|w| w[0] != w[1]),
            "the order changes from round to round: {rounds:?}"
        );
        // Each item lands on even and odd positions alike, so no item follows the parity
        // that nginx's alternation of two instances follows.
        let deck = Deck::seeded(8, 7);
        let mut even = [0u32; 8];
        for k in 0..8000 {
            let item = deck.draw();
            if k % 2 == 0 {
                even[item] += 1;
            }
        }
        assert!(even.iter().all(|&n| (350..=650).contains(&n)), "{even:?}");
        assert_eq!(Deck::new(1).draw(), 0);
    }
}

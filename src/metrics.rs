//! Prometheus metrics, kept in atomics and rendered in the text exposition format (0.0.4).
//! Label sets are small and known in advance (strategies x outcomes), so every series
//! exists from the start and a scrape never allocates a label map.

use std::fmt::Write;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::strategy::Strategy;

/// How a sale ended, as counted in `inventory_sales_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Sold,
    SoldOut,
    LockTimeout,
    LockLost,
    StaleFence,
    InProgress,
    StockChanged,
    UnknownItem,
    RedisUnavailable,
    RedisAuth,
    OutcomeUnknown,
    TooMuchContention,
    PoolExhausted,
    NotReplicated,
    ClientGone,
}

impl Outcome {
    const ALL: [Outcome; 15] = [
        Outcome::Sold,
        Outcome::SoldOut,
        Outcome::LockTimeout,
        Outcome::LockLost,
        Outcome::StaleFence,
        Outcome::InProgress,
        Outcome::StockChanged,
        Outcome::UnknownItem,
        Outcome::RedisUnavailable,
        Outcome::RedisAuth,
        Outcome::OutcomeUnknown,
        Outcome::TooMuchContention,
        Outcome::PoolExhausted,
        Outcome::NotReplicated,
        Outcome::ClientGone,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Outcome::Sold => "sold",
            Outcome::SoldOut => "sold_out",
            Outcome::LockTimeout => "lock_timeout",
            Outcome::LockLost => "lock_lost",
            Outcome::StaleFence => "stale_fence",
            Outcome::InProgress => "in_progress",
            Outcome::StockChanged => "stock_changed",
            Outcome::UnknownItem => "unknown_item",
            Outcome::RedisUnavailable => "redis_unavailable",
            Outcome::RedisAuth => "redis_auth_failed",
            Outcome::OutcomeUnknown => "outcome_unknown",
            Outcome::TooMuchContention => "too_much_contention",
            Outcome::PoolExhausted => "pool_exhausted",
            Outcome::NotReplicated => "not_replicated",
            Outcome::ClientGone => "client_gone",
        }
    }
}

const STRATEGIES: usize = Strategy::ALL.len();
const OUTCOMES: usize = Outcome::ALL.len();
/// Upper bounds of the lock-wait buckets, in seconds.
const WAIT_BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

#[derive(Default)]
struct Histogram {
    buckets: [AtomicU64; WAIT_BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        for (bound, bucket) in WAIT_BUCKETS.iter().zip(&self.buckets) {
            if secs <= *bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    /// Its series: buckets, `+Inf`, sum and count; `labels` is empty or ends with a comma.
    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        for (bound, bucket) in WAIT_BUCKETS.iter().zip(&self.buckets) {
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}le=\"{bound}\"}} {}",
                load(bucket)
            );
        }
        let count = load(&self.count);
        let plain = labels.trim_end_matches(',');
        let _ = writeln!(out, "{name}_bucket{{{labels}le=\"+Inf\"}} {count}");
        let sum = load(&self.sum_micros) as f64 / 1e6;
        if plain.is_empty() {
            let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {count}");
        } else {
            let _ = writeln!(
                out,
                "{name}_sum{{{plain}}} {sum}\n{name}_count{{{plain}}} {count}"
            );
        }
    }
}

/// What one node of a quorum lock answered to one acquire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vote {
    Granted,
    /// Held by another owner.
    Busy,
    /// No answer in time, or an error.
    Failed,
}

impl Vote {
    const ALL: [Vote; 3] = [Vote::Granted, Vote::Busy, Vote::Failed];

    fn label(self) -> &'static str {
        match self {
            Vote::Granted => "granted",
            Vote::Busy => "busy",
            Vote::Failed => "failed",
        }
    }
}

struct NodeVotes {
    node: String,
    votes: [AtomicU64; 3],
}

/// The pool's state at a scrape.
#[derive(Debug, Clone, Copy, Default)]
pub struct PoolGauges {
    pub max_size: u64,
    /// Connections open (idle or in use).
    pub open: u64,
    pub in_use: u64,
    /// Calls waiting for a free connection now.
    pub waiting: u64,
}

type PoolProbe = Box<dyn Fn() -> PoolGauges + Send + Sync>;

#[derive(Default)]
pub struct Metrics {
    pool: std::sync::Mutex<Option<PoolProbe>>,
    pool_waits: AtomicU64,
    pool_exhausted: AtomicU64,
    /// Per strategy: optimistic transactions whose `EXEC` found a watched key changed.
    conflicts: [AtomicU64; STRATEGIES],
    /// Per strategy: attempts beyond a sale's first.
    retries: [AtomicU64; STRATEGIES],
    /// Per strategy: business time spent in attempts whose write was thrown away.
    wasted_work_micros: [AtomicU64; STRATEGIES],
    /// The nodes of `LOCK_NODES` (host:port), set once at start-up.
    nodes: OnceLock<Vec<NodeVotes>>,
    quorum_failures: AtomicU64,
    validity_left: Histogram,
    sales: [[AtomicU64; OUTCOMES]; STRATEGIES],
    /// Answers replayed for a repeated `Idempotency-Key`: `[sold, sold_out]`.
    replays: [[AtomicU64; 2]; STRATEGIES],
    lock_wait: [Histogram; STRATEGIES],
    renewals: AtomicU64,
    locks_lost: AtomicU64,
    fence_refusals: AtomicU64,
    redis_errors: AtomicU64,
    /// Items other than `ITEM_ID` whose lock machinery is built now.
    items_live: AtomicU64,
}

fn index(strategy: Strategy) -> usize {
    Strategy::ALL
        .iter()
        .position(|s| *s == strategy)
        .unwrap_or(0)
}

impl Metrics {
    pub fn sale(&self, strategy: Strategy, outcome: Outcome) {
        let o = Outcome::ALL.iter().position(|x| *x == outcome).unwrap_or(0);
        self.sales[index(strategy)][o].fetch_add(1, Ordering::Relaxed);
        if outcome == Outcome::StaleFence {
            self.fence_refusals.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A repeated `Idempotency-Key` answered with its first attempt's sale or `sold_out`:
    /// counted apart, so that `inventory_sales_total` counts each sale (and each refusal)
    /// once, as the ledger does.
    pub fn replay(&self, strategy: Strategy, sold: bool) {
        self.replays[index(strategy)][usize::from(!sold)].fetch_add(1, Ordering::Relaxed);
    }

    /// How many items other than `ITEM_ID` have their lock machinery built now.
    pub fn items_live(&self, n: usize) {
        self.items_live.store(n as u64, Ordering::Relaxed);
    }

    pub fn lock_wait(&self, strategy: Strategy, waited: Duration) {
        self.lock_wait[index(strategy)].observe(waited);
    }

    pub fn renewal(&self) {
        self.renewals.fetch_add(1, Ordering::Relaxed);
    }

    pub fn lock_lost(&self) {
        self.locks_lost.fetch_add(1, Ordering::Relaxed);
    }

    /// Names the nodes of a quorum lock (host:port, never a password), in `LOCK_NODES` order.
    pub fn register_nodes(&self, nodes: Vec<String>) {
        let nodes = nodes
            .into_iter()
            .map(|node| NodeVotes {
                node,
                votes: Default::default(),
            })
            .collect();
        let _ = self.nodes.set(nodes);
    }

    pub fn node_vote(&self, node: usize, vote: Vote) {
        let v = Vote::ALL.iter().position(|x| *x == vote).unwrap_or(0);
        if let Some(n) = self.nodes.get().and_then(|nodes| nodes.get(node)) {
            n.votes[v].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A quorum acquire's result: the validity left when a majority granted it in time,
    /// `None` when it failed.
    pub fn quorum(&self, validity_left: Option<Duration>) {
        match validity_left {
            Some(left) => self.validity_left.observe(left),
            None => {
                self.quorum_failures.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The pool to report; the newest registered wins (a store sized after its creation).
    pub fn register_pool(&self, probe: PoolProbe) {
        if let Ok(mut pool) = self.pool.lock() {
            *pool = Some(probe);
        }
    }

    /// A checkout found every connection in use and had to wait.
    pub fn pool_wait(&self) {
        self.pool_waits.fetch_add(1, Ordering::Relaxed);
    }

    /// A checkout waited `REDIS_POOL_WAIT_MS` in vain.
    pub fn pool_exhausted(&self) {
        self.pool_exhausted.fetch_add(1, Ordering::Relaxed);
    }

    /// An optimistic attempt's `EXEC` was refused (nil): the work it did is thrown away and
    /// the sale tries again (or gives up).
    pub fn conflict(&self, strategy: Strategy, wasted: Duration) {
        let i = index(strategy);
        self.conflicts[i].fetch_add(1, Ordering::Relaxed);
        self.wasted_work_micros[i].fetch_add(wasted.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn retry(&self, strategy: Strategy) {
        self.retries[index(strategy)].fetch_add(1, Ordering::Relaxed);
    }

    pub fn redis_error(&self) {
        self.redis_errors.fetch_add(1, Ordering::Relaxed);
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);

        out.push_str("# HELP inventory_sales_total Sales attempted, by strategy and outcome.\n");
        out.push_str("# TYPE inventory_sales_total counter\n");
        for (strategy, row) in Strategy::ALL.iter().zip(&self.sales) {
            for (outcome, n) in Outcome::ALL.iter().zip(row) {
                let _ = writeln!(
                    out,
                    "inventory_sales_total{{strategy=\"{strategy}\",outcome=\"{}\"}} {}",
                    outcome.label(),
                    load(n)
                );
            }
        }

        out.push_str(
            "# HELP inventory_sales_replayed_total Answers replayed for a repeated \
             Idempotency-Key (not counted in inventory_sales_total), by outcome and strategy: \
             the strategy that sold, for a sale; the one the retry asked for, for a sold_out.\n",
        );
        out.push_str("# TYPE inventory_sales_replayed_total counter\n");
        for (strategy, row) in Strategy::ALL.iter().zip(&self.replays) {
            for (outcome, n) in ["sold", "sold_out"].iter().zip(row) {
                let _ = writeln!(
                    out,
                    "inventory_sales_replayed_total{{strategy=\"{strategy}\",outcome=\"{outcome}\"}} {}",
                    load(n)
                );
            }
        }

        out.push_str("# HELP inventory_lock_wait_seconds Time spent waiting for the lock.\n");
        out.push_str("# TYPE inventory_lock_wait_seconds histogram\n");
        for (strategy, h) in Strategy::ALL.iter().zip(&self.lock_wait) {
            h.render(
                &mut out,
                "inventory_lock_wait_seconds",
                &format!("strategy=\"{strategy}\","),
            );
        }

        for (name, help, values, scale) in [
            (
                "inventory_optimistic_conflicts_total",
                "Transactions whose EXEC was refused because a watched key changed.",
                &self.conflicts,
                1.0,
            ),
            (
                "inventory_sale_retries_total",
                "Attempts beyond a sale's first (divide by sold sales: retries per sale).",
                &self.retries,
                1.0,
            ),
            (
                "inventory_wasted_work_seconds_total",
                "Business time spent in attempts whose write was thrown away.",
                &self.wasted_work_micros,
                1e6,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for (strategy, n) in Strategy::ALL.iter().zip(values) {
                let value = load(n) as f64 / scale;
                let _ = writeln!(out, "{name}{{strategy=\"{strategy}\"}} {value}");
            }
        }

        let _ = writeln!(
            out,
            "# HELP inventory_items_live Items other than ITEM_ID whose lock machinery \
             (listeners, local mutex) is built now; an item idle for ITEM_IDLE_MS is dropped.\n\
             # TYPE inventory_items_live gauge\ninventory_items_live {}",
            load(&self.items_live)
        );

        let gauges = self
            .pool
            .lock()
            .ok()
            .and_then(|probe| probe.as_ref().map(|probe| probe()));
        if let Some(g) = gauges {
            for (name, help, value) in [
                (
                    "inventory_redis_pool_size",
                    "Most connections the pool opens (REDIS_POOL_SIZE).",
                    g.max_size,
                ),
                (
                    "inventory_redis_pool_open",
                    "Pooled connections open now.",
                    g.open,
                ),
                (
                    "inventory_redis_pool_in_use",
                    "Pooled connections checked out now.",
                    g.in_use,
                ),
                (
                    "inventory_redis_pool_waiting",
                    "Calls waiting for a free pooled connection now.",
                    g.waiting,
                ),
            ] {
                let _ = writeln!(
                    out,
                    "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
                );
            }
        }

        if let Some(nodes) = self.nodes.get() {
            out.push_str("# HELP inventory_lock_node_votes_total Answers of each lock node to quorum acquires.\n");
            out.push_str("# TYPE inventory_lock_node_votes_total counter\n");
            for n in nodes {
                for (vote, count) in Vote::ALL.iter().zip(&n.votes) {
                    let _ = writeln!(
                        out,
                        "inventory_lock_node_votes_total{{node=\"{}\",vote=\"{}\"}} {}",
                        n.node,
                        vote.label(),
                        load(count)
                    );
                }
            }
            out.push_str("# HELP inventory_lock_validity_left_seconds Lease left when a quorum acquire succeeded (lease - time spent - drift).\n");
            out.push_str("# TYPE inventory_lock_validity_left_seconds histogram\n");
            self.validity_left
                .render(&mut out, "inventory_lock_validity_left_seconds", "");
        }

        for (name, help, value) in [
            (
                "inventory_lock_quorum_failures_total",
                "Quorum acquires that did not reach a majority within the validity.",
                &self.quorum_failures,
            ),
            (
                "inventory_lock_renewals_total",
                "Lease renewals made by the watchdog.",
                &self.renewals,
            ),
            (
                "inventory_locks_lost_total",
                "Locks found gone or taken by their holder's watchdog.",
                &self.locks_lost,
            ),
            (
                "inventory_fence_refusals_total",
                "Sales refused because a newer fencing token was seen.",
                &self.fence_refusals,
            ),
            (
                "inventory_redis_pool_waits_total",
                "Checkouts that found every pooled connection in use and waited.",
                &self.pool_waits,
            ),
            (
                "inventory_redis_pool_exhausted_total",
                "Checkouts that waited REDIS_POOL_WAIT_MS in vain (503 pool_exhausted).",
                &self.pool_exhausted,
            ),
            (
                "inventory_redis_errors_total",
                "Redis calls that failed or timed out.",
                &self.redis_errors,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                load(value)
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histogram_counts_each_observation_in_every_bucket_at_or_above_it() {
        let m = Metrics::default();
        m.lock_wait(Strategy::Local, Duration::from_millis(30));
        let text = m.render();
        assert!(
            text.contains("inventory_lock_wait_seconds_bucket{strategy=\"local\",le=\"0.025\"} 0")
        );
        assert!(
            text.contains("inventory_lock_wait_seconds_bucket{strategy=\"local\",le=\"0.05\"} 1")
        );
        assert!(
            text.contains("inventory_lock_wait_seconds_bucket{strategy=\"local\",le=\"+Inf\"} 1")
        );
        assert!(text.contains("inventory_lock_wait_seconds_count{strategy=\"local\"} 1"));
    }

    #[test]
    fn sales_are_counted_by_strategy_and_outcome() {
        let m = Metrics::default();
        m.sale(Strategy::Atomic, Outcome::Sold);
        m.sale(Strategy::Atomic, Outcome::Sold);
        m.sale(
            Strategy::Redis(crate::strategy::RedisLock::Fenced),
            Outcome::StaleFence,
        );
        let text = m.render();
        assert!(text.contains("inventory_sales_total{strategy=\"atomic\",outcome=\"sold\"} 2"));
        assert!(
            text.contains("inventory_sales_total{strategy=\"fenced\",outcome=\"stale_fence\"} 1")
        );
        assert!(text.contains("inventory_fence_refusals_total 1"));
    }
}

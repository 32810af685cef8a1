//! `none`: no lock at all; each sale reads the stock, works, and writes stock - 1.
//! Fixes: nothing; it is the baseline every other strategy is measured against.
//! Still wrong: two sales that overlap read the same stock and both write it: lost updates,
//! even on a single instance.

use super::StrategyInfo;

pub(super) const INFO: StrategyInfo = StrategyInfo {
    name: "none",
    aliases: &[],
    seed: "-",
    protocol: "no lock: GET, work, SET",
    fixes: "nothing (the baseline)",
    flaw: "lost updates even on one instance: overlapping sales read the same stock",
    reentrant: true,
    renews: false,
    fenced: false,
    distributed: false,
};

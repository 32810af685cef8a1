//! `none`: no lock at all; each sale reads the stock, works, and writes stock - 1.
//! Fixes: nothing; it is the baseline every other strategy is measured against.
//! Still wrong: two sales that overlap read the same stock and both write it: lost updates,
//! even on a single instance.

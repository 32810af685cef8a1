//! What the tools that start their own topologies (`failover-table`, `cluster-table`) share.

use std::path::PathBuf;
use std::process::ExitCode;

/// `--inventory-bin`: which `inventory` the tool starts.
#[derive(Debug, Clone, clap::Args)]
pub struct InventoryBin {
    /// The `inventory` binary (default: the one next to this executable).
    #[arg(long = "inventory-bin", env = "INVENTORY_BIN")]
    path: Option<PathBuf>,
}

impl InventoryBin {
    pub fn resolve(&self) -> anyhow::Result<PathBuf> {
        match &self.path {
            Some(path) => Ok(path.clone()),
            None => testkit::inventory_binary(),
        }
    }
}

/// A tool's exit status, its error (with causes) on stderr under its name.
pub fn exit(tool: &str, result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{tool}: {e:#}");
            ExitCode::FAILURE
        }
    }
}

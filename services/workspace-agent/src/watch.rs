//! Watches the context's files and asks for a reload, debounced.
//!
//! Watched: the directory of every MCP config file and instruction file
//! (non-recursive, events filtered to those files, so atomic saves by rename
//! are seen) and every skills dir (recursive). A directory that does not exist
//! when the agent starts is not watched.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::context_config::ContextConfig;

/// Starts watching; each burst of changes sends one `()` on `reload` once no
/// further change came for `debounce`.
pub fn spawn(
    config: &ContextConfig,
    debounce: Duration,
    reload: mpsc::UnboundedSender<()>,
    shutdown: CancellationToken,
) -> Result<JoinHandle<()>, notify::Error> {
    let mut files: BTreeSet<PathBuf> = config.mcp_config_files.iter().cloned().collect();
    files.extend(
        config
            .instructions_dirs
            .iter()
            .chain(config.working_dir.iter())
            .map(|dir| dir.join(&config.instructions_file)),
    );
    let trees: Vec<PathBuf> = config
        .skills_dirs
        .iter()
        .filter(|d| d.is_dir())
        .cloned()
        .collect();
    let parents: BTreeSet<PathBuf> = files
        .iter()
        .filter_map(|f| f.parent().map(Path::to_path_buf))
        .filter(|d| d.is_dir())
        .collect();

    let (changes_tx, mut changes) = mpsc::unbounded_channel::<()>();
    let relevant_files = files.clone();
    let relevant_trees = trees.clone();
    let mut watcher =
        notify::recommended_watcher(move |event: notify::Result<notify::Event>| match event {
            Ok(event) => {
                if event.kind.is_access() {
                    return;
                }
                let relevant = event.paths.iter().any(|p| {
                    relevant_files.contains(p) || relevant_trees.iter().any(|t| p.starts_with(t))
                });
                if relevant {
                    let _ = changes_tx.send(());
                }
            }
            Err(error) => tracing::warn!(%error, "file watch error"),
        })?;
    for dir in &parents {
        watcher.watch(dir, RecursiveMode::NonRecursive)?;
    }
    for tree in &trees {
        watcher.watch(tree, RecursiveMode::Recursive)?;
    }
    tracing::info!(
        dirs = parents.len(),
        skills_dirs = trees.len(),
        "watching context files"
    );
    Ok(tokio::spawn(async move {
        // Keep the watcher alive as long as the task.
        let _watcher = watcher;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                change = changes.recv() => if change.is_none() { return },
            }
            // Debounce: wait until the burst is over.
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    more = tokio::time::timeout(debounce, changes.recv()) => match more {
                        Ok(Some(())) => continue,
                        Ok(None) => return,
                        Err(_) => break,
                    },
                }
            }
            tracing::info!("context files changed; reloading");
            if reload.send(()).is_err() {
                return;
            }
        }
    }))
}

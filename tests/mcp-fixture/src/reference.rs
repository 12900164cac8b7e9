//! The public reference MCP servers installed by `tests/mcp-servers/install.sh`
//! into `CTXSYNC_MCP_SERVERS_DIR` (default `~/.cache/ctxsync/mcp-servers`).
//! A missing install is a test failure (panic), never a skip.

use std::path::{Path, PathBuf};

use ctxsync_mcp::{ServerSpec, TransportSpec};

/// The install directory.
pub fn servers_dir() -> PathBuf {
    match std::env::var_os("CTXSYNC_MCP_SERVERS_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => {
            let home = std::env::var_os("HOME").expect("HOME is set");
            PathBuf::from(home).join(".cache/ctxsync/mcp-servers")
        }
    }
}

fn installed(relative: &str) -> PathBuf {
    let dir = servers_dir();
    let path = dir.join(relative);
    assert!(
        path.is_file(),
        "reference MCP server {} is not installed in {}: run tests/mcp-servers/install.sh \
         (CTXSYNC_MCP_SERVERS_DIR selects the directory)",
        path.display(),
        dir.display()
    );
    path
}

fn spec(name: &str, command: PathBuf, args: Vec<String>) -> ServerSpec {
    ServerSpec {
        name: name.to_string(),
        transport: TransportSpec::Stdio {
            command: command.display().to_string(),
            args,
            env: Default::default(),
            cwd: None,
        },
    }
}

/// `@modelcontextprotocol/server-everything` (stdio).
pub fn everything() -> ServerSpec {
    spec(
        "everything",
        installed("node_modules/.bin/mcp-server-everything"),
        vec!["stdio".to_string()],
    )
}

/// `@modelcontextprotocol/server-filesystem` allowed to access `root`.
pub fn filesystem(root: &Path) -> ServerSpec {
    spec(
        "filesystem",
        installed("node_modules/.bin/mcp-server-filesystem"),
        vec![root.display().to_string()],
    )
}

/// `@modelcontextprotocol/server-memory`; its store lives at `memory_file`.
pub fn memory(memory_file: &Path) -> ServerSpec {
    let mut spec = spec(
        "memory",
        installed("node_modules/.bin/mcp-server-memory"),
        Vec::new(),
    );
    if let TransportSpec::Stdio { env, .. } = &mut spec.transport {
        env.insert(
            "MEMORY_FILE_PATH".to_string(),
            memory_file.display().to_string(),
        );
    }
    spec
}

/// `mcp-server-time` from PyPI, with a fixed local timezone.
pub fn time() -> ServerSpec {
    spec(
        "time",
        installed("venv/bin/mcp-server-time"),
        vec!["--local-timezone".to_string(), "UTC".to_string()],
    )
}

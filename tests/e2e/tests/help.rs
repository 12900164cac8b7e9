//! What an operator reads first: every binary's `--help`. Only a setting
//! without a default is shown as required in the usage line, every default
//! is printed as `[default: …]`. (That no help text cites a document missing
//! from the repository is checked over the sources by `tests/tidy`.)

use std::process::Command;

use testkit::workspace_binary;

/// (package, binary, its usage line).
const BINARIES: &[(&str, &str, &str)] = &[
    (
        "snapshot-store",
        "snapshot-store",
        "Usage: snapshot-store [OPTIONS]",
    ),
    (
        "agent-ingest",
        "agent-ingest",
        "Usage: agent-ingest [OPTIONS]",
    ),
    ("chat-gate", "chat-gate", "Usage: chat-gate [OPTIONS]"),
    // The one setting with no sane default: which servers to run.
    (
        "catalog",
        "catalog",
        "Usage: catalog [OPTIONS] --config <CONFIG>",
    ),
    (
        "workspace-agent",
        "workspace-agent",
        "Usage: workspace-agent [OPTIONS] [COMMAND]",
    ),
    ("ctxsync-cli", "ctxsync", "Usage: ctxsync <COMMAND>"),
];

#[test]
fn every_binary_shows_only_settings_without_a_default_as_required() {
    for (package, bin, usage) in BINARIES {
        let output = Command::new(workspace_binary(package, bin))
            .arg("--help")
            .env_clear()
            .output()
            .unwrap();
        assert!(output.status.success(), "{bin}: {output:?}");
        let help = String::from_utf8_lossy(&output.stdout);
        let line = help
            .lines()
            .find(|l| l.starts_with("Usage:"))
            .unwrap_or_else(|| panic!("{bin}: no usage line:\n{help}"));
        assert_eq!(line, *usage, "{bin}");
        // Each service flag that has a default says so: the shared ones.
        if !matches!(*bin, "ctxsync" | "workspace-agent") {
            for flag in [
                "--subject-prefix",
                "--http-addr",
                "--log-format",
                "--log-filter",
            ] {
                let block = option_block(&help, flag)
                    .unwrap_or_else(|| panic!("{bin}: no {flag}:\n{help}"));
                assert!(block.contains("[default: "), "{bin} {flag}: {block}");
            }
        }
    }
}

/// The lines of one option, from its flag to the next option.
fn option_block(help: &str, flag: &str) -> Option<String> {
    let mut lines = help
        .lines()
        .skip_while(|l| !l.trim_start().starts_with(flag));
    let first = lines.next()?;
    // Options start at most six columns in; possible values are deeper.
    let rest = lines.take_while(|l| {
        let indent = l.len() - l.trim_start().len();
        !(indent <= 6 && l.trim_start().starts_with('-'))
    });
    Some(
        std::iter::once(first)
            .chain(rest)
            .collect::<Vec<_>>()
            .join("\n"),
    )
}

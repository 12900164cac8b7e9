//! Helpers for the deployment checks in `tests/`: repository paths, the
//! external tools `tests/setup.sh` installs, YAML documents, a reader for the
//! NATS server config, NATS subject matching, and the env names the code reads.
//!
//! A missing tool fails the test with what to install; it never skips.

pub mod nats_conf;
pub mod pods;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("repository root")
}

/// `deploy/` in the repository.
pub fn deploy_dir() -> PathBuf {
    repo_root().join("deploy")
}

/// Where `tests/setup.sh` installs the deployment tools.
pub fn tools_dir() -> PathBuf {
    match std::env::var_os("CTXSYNC_TOOLS_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => {
            let home = std::env::var_os("HOME").expect("HOME is not set");
            PathBuf::from(home).join(".cache/ctxsync/tools")
        }
    }
}

/// Finds `name` in `<tools dir>/bin`, then on PATH; panics with what to run when it is missing.
pub fn tool(name: &str) -> PathBuf {
    let installed = tools_dir().join("bin").join(name);
    if installed.is_file() {
        return installed;
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return candidate;
            }
        }
    }
    panic!(
        "`{name}` is needed to validate deploy/ and was found neither in {} nor on PATH: \
         run `bash tests/setup.sh` (it installs kubectl, kubernetes-validate, check-jsonschema \
         and nats-server)",
        tools_dir().join("bin").display()
    );
}

/// Runs a command to completion; panics with its output when it fails.
pub fn run(command: &mut Command) -> String {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    if !output.status.success() {
        panic!(
            "{command:?} failed ({}):\n{stdout}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    stdout
}

/// Every document of a multi-document YAML text, with `<<` merge keys applied.
pub fn yaml_documents(text: &str) -> Vec<serde_norway::Value> {
    use serde::Deserialize as _;
    serde_norway::Deserializer::from_str(text)
        .map(|document| {
            let mut value = serde_norway::Value::deserialize(document).expect("valid YAML");
            // A merged mapping may hold merge keys of its own (an anchor
            // built on another): merge until none is left.
            loop {
                let before = value.clone();
                value.apply_merge().expect("valid YAML merge keys");
                if value == before {
                    break value;
                }
            }
        })
        .filter(|value| !value.is_null())
        .collect()
}

/// One YAML file, merge keys applied.
pub fn read_yaml(path: &Path) -> serde_norway::Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let mut documents = yaml_documents(&text);
    assert_eq!(documents.len(), 1, "{} holds one document", path.display());
    documents.remove(0)
}

/// Does the NATS subject pattern `pattern` (`*` one token, `>` the rest) match `subject`?
/// A pattern also "matches" a narrower pattern, e.g. `a.>` matches `a.b.*`.
pub fn subject_matches(pattern: &str, subject: &str) -> bool {
    let pattern: Vec<&str> = pattern.split('.').collect();
    let subject: Vec<&str> = subject.split('.').collect();
    for (i, token) in pattern.iter().enumerate() {
        match *token {
            ">" => return subject.len() > i,
            "*" => {
                if i >= subject.len() || subject[i] == ">" {
                    return false;
                }
            }
            literal => {
                if subject.get(i) != Some(&literal) {
                    return false;
                }
            }
        }
    }
    pattern.len() == subject.len()
}

/// Env var names the services read: clap `env = "..."` attributes and the
/// `CTXSYNC_*` string constants in `services/*/src`.
pub fn env_names_in_code() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut files = Vec::new();
    collect_rust_files(&repo_root().join("services"), &mut files);
    for file in files {
        let text = std::fs::read_to_string(&file).expect("readable source");
        for (i, _) in text.match_indices('"') {
            let rest = &text[i + 1..];
            let Some(end) = rest.find('"') else { break };
            let literal = &rest[..end];
            let before = text[..i].trim_end();
            let is_env_attr = before.ends_with("env =") || before.ends_with("env=");
            let looks_like_env = literal.starts_with("CTXSYNC_")
                && literal
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
            if (is_env_attr && !literal.is_empty()) || looks_like_env {
                names.insert(literal.to_owned());
            }
        }
    }
    names
}

/// Every string literal in `services/*/src` (escapes left as written).
pub fn string_literals_in_code() -> BTreeSet<String> {
    let mut literals = BTreeSet::new();
    let mut files = Vec::new();
    collect_rust_files(&repo_root().join("services"), &mut files);
    for file in files {
        let text = std::fs::read_to_string(&file).expect("readable source");
        // A quote as a char literal would turn the scan inside out.
        let text = text.replace("'\"'", "").replace("'\\\"'", "");
        let mut rest = text.as_str();
        while let Some(start) = rest.find('"') {
            let after = &rest[start + 1..];
            let mut end = None;
            let mut escaped = false;
            for (i, c) in after.char_indices() {
                match c {
                    '\\' if !escaped => escaped = true,
                    '"' if !escaped => {
                        end = Some(i);
                        break;
                    }
                    _ => escaped = false,
                }
            }
            let Some(end) = end else { break };
            literals.insert(after[..end].to_owned());
            rest = &after[end + 1..];
        }
    }
    literals
}

/// The metric names the services record or describe: `ctxsync_*` string
/// literals in `services/*/src`.
pub fn metric_names_in_code() -> BTreeSet<String> {
    string_literals_in_code()
        .into_iter()
        .filter(|l| {
            l.starts_with("ctxsync_")
                && l.len() > "ctxsync_".len()
                && l.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        })
        .collect()
}

/// Copies a directory tree (files and directories only).
pub fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create directory");
    for entry in std::fs::read_dir(from)
        .expect("readable directory")
        .flatten()
    {
        let target = to.join(entry.file_name());
        let kind = entry.file_type().expect("file type");
        if kind.is_dir() {
            copy_tree(&entry.path(), &target);
        } else if kind.is_file() {
            std::fs::copy(entry.path(), &target).expect("copy file");
        }
    }
}

fn collect_rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "target") {
                collect_rust_files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs")
            && path.components().any(|c| c.as_os_str() == "src")
        {
            out.push(path);
        }
    }
}

/// The NATS client name each service passes to `ctxsync_runtime::nats::connect`
/// (`services/<dir>/src/**`), as `(crate dir, client name)`.
pub fn nats_client_names_in_code() -> BTreeSet<(String, String)> {
    let mut names = BTreeSet::new();
    let services = repo_root().join("services");
    for entry in std::fs::read_dir(&services).expect("services/").flatten() {
        let mut files = Vec::new();
        collect_rust_files(&entry.path(), &mut files);
        for file in files {
            let text = std::fs::read_to_string(&file).expect("readable source");
            for (i, _) in text.match_indices("nats::connect(") {
                let call = &text[i..];
                let Some(close) = call.find(')') else {
                    continue;
                };
                let args = &call[..close];
                if let Some(start) = args.rfind(", \"") {
                    let name = args[start + 3..].trim_end_matches('"');
                    names.insert((
                        entry.file_name().to_string_lossy().into_owned(),
                        name.to_owned(),
                    ));
                }
            }
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::subject_matches;

    #[test]
    fn subjects_match_like_nats() {
        assert!(subject_matches("a.>", "a.b.c"));
        assert!(!subject_matches("a.>", "a"));
        assert!(subject_matches("a.*", "a.b"));
        assert!(!subject_matches("a.*", "a.b.c"));
        assert!(subject_matches("a.b", "a.b"));
        assert!(!subject_matches("a.b", "a.c"));
        assert!(subject_matches("a.>", "a.b.*"));
        assert!(!subject_matches("a.*", "a.>"));
        assert!(!subject_matches("_INBOX.x.>", "_INBOX.>"));
    }
}

//! The context configuration: where the agent looks for instruction files,
//! skills and MCP config files, read from `CTXSYNC_*` env vars and resolved
//! locally (`~`, relative against the working directory, absolute).
//!
//! The resolver takes the environment as a map and the home and working
//! directories as parameters, so it never reads the process environment itself.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use ctxsync_proto::v1;

pub const ENV_INSTRUCTIONS_DIRS: &str = "CTXSYNC_INSTRUCTIONS_DIRS";
pub const ENV_INSTRUCTIONS_FILE: &str = "CTXSYNC_INSTRUCTIONS_FILE";
pub const ENV_SKILLS_DIRS: &str = "CTXSYNC_SKILLS_DIRS";
pub const ENV_SKILL_META_FILE: &str = "CTXSYNC_SKILL_META_FILE";
pub const ENV_MCP_CONFIG_FILES: &str = "CTXSYNC_MCP_CONFIG_FILES";

pub const DEFAULT_INSTRUCTIONS_DIRS: &str = "~/.ctxsync";
pub const DEFAULT_INSTRUCTIONS_FILE: &str = "AGENTS.md";
pub const DEFAULT_SKILLS_DIRS: &str = ".agents/skills";
pub const DEFAULT_SKILL_META_FILE: &str = "SKILL.md";
pub const DEFAULT_MCP_CONFIG_FILES: &str =
    ".mcp.json,.vscode/mcp.json,.cursor/mcp.json,.roo/mcp.json";

/// The resolved context configuration. Every path is absolute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextConfig {
    /// The working directory; `None` when the agent has none (relative paths are then dropped).
    pub working_dir: Option<PathBuf>,
    pub instructions_dirs: Vec<PathBuf>,
    pub instructions_file: String,
    pub skills_dirs: Vec<PathBuf>,
    pub skill_meta_file: String,
    pub mcp_config_files: Vec<PathBuf>,
}

impl ContextConfig {
    /// Reads the `CTXSYNC_*` variables of `env`, falling back to the defaults for
    /// unset or blank ones, and resolves every path against `home` and `working_dir`.
    pub fn resolve(
        env: &BTreeMap<String, String>,
        home: Option<&Path>,
        working_dir: Option<&Path>,
    ) -> Self {
        let working_dir = working_dir.filter(|d| d.is_absolute()).map(normalize);
        let home = home.filter(|h| h.is_absolute());
        let base = working_dir.as_deref();
        let value = |name: &str, default: &'static str| -> String {
            match env.get(name) {
                Some(v) if !v.trim().is_empty() => v.clone(),
                _ => default.to_owned(),
            }
        };
        let name = |name: &str, default: &'static str| -> String {
            let v = value(name, default);
            v.trim().to_owned()
        };
        Self {
            instructions_dirs: resolve_paths(
                &value(ENV_INSTRUCTIONS_DIRS, DEFAULT_INSTRUCTIONS_DIRS),
                home,
                base,
            ),
            instructions_file: name(ENV_INSTRUCTIONS_FILE, DEFAULT_INSTRUCTIONS_FILE),
            skills_dirs: resolve_paths(&value(ENV_SKILLS_DIRS, DEFAULT_SKILLS_DIRS), home, base),
            skill_meta_file: name(ENV_SKILL_META_FILE, DEFAULT_SKILL_META_FILE),
            mcp_config_files: resolve_paths(
                &value(ENV_MCP_CONFIG_FILES, DEFAULT_MCP_CONFIG_FILES),
                home,
                base,
            ),
            working_dir,
        }
    }

    /// The form sent in every push.
    pub fn to_proto(&self) -> v1::ContextConfig {
        let s = |p: &Path| p.display().to_string();
        v1::ContextConfig {
            working_dir: self.working_dir.as_deref().map(s).unwrap_or_default(),
            instructions_dirs: self.instructions_dirs.iter().map(|p| s(p)).collect(),
            instructions_file: self.instructions_file.clone(),
            skills_dirs: self.skills_dirs.iter().map(|p| s(p)).collect(),
            skill_meta_file: self.skill_meta_file.clone(),
            mcp_config_files: self.mcp_config_files.iter().map(|p| s(p)).collect(),
        }
    }
}

/// Resolves one path: `~` and `~/x` against `home`, absolute as is, relative
/// against `base`. `None` when the path is blank or needs a base (home or
/// working directory) that is missing.
pub fn resolve_path(raw: &str, home: Option<&Path>, base: Option<&Path>) -> Option<PathBuf> {
    let raw = raw.trim();
    if raw.is_empty() {
        return None;
    }
    let resolved = if raw == "~" {
        home?.to_path_buf()
    } else if let Some(rest) = raw.strip_prefix("~/") {
        home?.join(rest)
    } else if Path::new(raw).is_absolute() {
        PathBuf::from(raw)
    } else {
        let base = base.filter(|b| b.is_absolute())?;
        base.join(raw)
    };
    Some(normalize(&resolved))
}

/// Resolves a comma-separated list, trimming each entry, dropping blank and
/// unresolvable ones and repeated paths (first occurrence kept).
pub fn resolve_paths(list: &str, home: Option<&Path>, base: Option<&Path>) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    for entry in list.split(',') {
        if let Some(path) = resolve_path(entry, home, base)
            && !out.contains(&path)
        {
            out.push(path);
        }
    }
    out
}

/// Removes `.` components and trailing slashes; keeps `..` (symlinks make
/// lexical `..` removal wrong; repeated files are caught by identity on read).
fn normalize(path: &Path) -> PathBuf {
    path.components()
        .filter(|c| !matches!(c, Component::CurDir))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    const HOME: &str = "/home/u";
    const WORK: &str = "/work/ws";

    fn resolve(pairs: &[(&str, &str)]) -> ContextConfig {
        ContextConfig::resolve(&env(pairs), Some(Path::new(HOME)), Some(Path::new(WORK)))
    }

    fn paths(list: &[&str]) -> Vec<PathBuf> {
        list.iter().map(PathBuf::from).collect()
    }

    #[test]
    fn defaults_apply_when_nothing_is_set() {
        let config = resolve(&[]);
        assert_eq!(config.working_dir, Some(PathBuf::from(WORK)));
        assert_eq!(config.instructions_dirs, paths(&["/home/u/.ctxsync"]));
        assert_eq!(config.instructions_file, "AGENTS.md");
        assert_eq!(config.skills_dirs, paths(&["/work/ws/.agents/skills"]));
        assert_eq!(config.skill_meta_file, "SKILL.md");
        assert_eq!(
            config.mcp_config_files,
            paths(&[
                "/work/ws/.mcp.json",
                "/work/ws/.vscode/mcp.json",
                "/work/ws/.cursor/mcp.json",
                "/work/ws/.roo/mcp.json"
            ])
        );
    }

    #[test]
    fn blank_values_fall_back_to_defaults() {
        let config = resolve(&[(ENV_INSTRUCTIONS_DIRS, "   "), (ENV_INSTRUCTIONS_FILE, "")]);
        assert_eq!(config.instructions_dirs, paths(&["/home/u/.ctxsync"]));
        assert_eq!(config.instructions_file, "AGENTS.md");
    }

    #[test]
    fn custom_env_vars_replace_the_defaults() {
        let config = resolve(&[
            (ENV_INSTRUCTIONS_DIRS, "/opt/company/agent-config"),
            (ENV_INSTRUCTIONS_FILE, "CLAUDE.md"),
            (ENV_SKILLS_DIRS, "/opt/company/ai-skills"),
            (ENV_SKILL_META_FILE, "META.md"),
            (ENV_MCP_CONFIG_FILES, "/opt/company/mcp.json"),
        ]);
        assert_eq!(
            config.instructions_dirs,
            paths(&["/opt/company/agent-config"])
        );
        assert_eq!(config.instructions_file, "CLAUDE.md");
        assert_eq!(config.skills_dirs, paths(&["/opt/company/ai-skills"]));
        assert_eq!(config.skill_meta_file, "META.md");
        assert_eq!(config.mcp_config_files, paths(&["/opt/company/mcp.json"]));
    }

    #[test]
    fn whitespace_around_values_and_entries_is_trimmed() {
        let config = resolve(&[
            (ENV_INSTRUCTIONS_DIRS, "  /a ,  /b  "),
            (ENV_INSTRUCTIONS_FILE, "  CLAUDE.md \n"),
            (ENV_SKILL_META_FILE, "\tMETA.md "),
            (ENV_MCP_CONFIG_FILES, " .mcp.json , /etc/mcp.json "),
        ]);
        assert_eq!(config.instructions_dirs, paths(&["/a", "/b"]));
        assert_eq!(config.instructions_file, "CLAUDE.md");
        assert_eq!(config.skill_meta_file, "META.md");
        assert_eq!(
            config.mcp_config_files,
            paths(&["/work/ws/.mcp.json", "/etc/mcp.json"])
        );
    }

    #[test]
    fn comma_separated_dirs_keep_their_order_and_skip_empty_and_repeated_entries() {
        let config = resolve(&[
            (
                ENV_INSTRUCTIONS_DIRS,
                "/opt/company/agent-config,~/.ctxsync,,/opt/company/agent-config",
            ),
            (ENV_SKILLS_DIRS, "/opt/company/ai-skills,.agents/skills"),
        ]);
        assert_eq!(
            config.instructions_dirs,
            paths(&["/opt/company/agent-config", "/home/u/.ctxsync"])
        );
        assert_eq!(
            config.skills_dirs,
            paths(&["/opt/company/ai-skills", "/work/ws/.agents/skills"])
        );
    }

    #[test]
    fn tilde_relative_and_absolute_paths_resolve_locally() {
        let home = Some(Path::new(HOME));
        let base = Some(Path::new(WORK));
        assert_eq!(
            resolve_path("~", home, base),
            Some(PathBuf::from("/home/u"))
        );
        assert_eq!(
            resolve_path("~/x/y", home, base),
            Some(PathBuf::from("/home/u/x/y"))
        );
        assert_eq!(
            resolve_path("/abs/./p/", home, base),
            Some(PathBuf::from("/abs/p"))
        );
        assert_eq!(
            resolve_path("rel/p", home, base),
            Some(PathBuf::from("/work/ws/rel/p"))
        );
        assert_eq!(
            resolve_path("./rel", home, base),
            Some(PathBuf::from("/work/ws/rel"))
        );
        assert_eq!(resolve_path("  ", home, base), None);
    }

    #[test]
    fn relative_path_without_a_base_is_dropped() {
        assert_eq!(resolve_path("rel/p", Some(Path::new(HOME)), None), None);
        assert_eq!(resolve_path("~/x", None, Some(Path::new(WORK))), None);
        // A relative "base" is no base.
        assert_eq!(resolve_path("rel", None, Some(Path::new("ws"))), None);
        let config = ContextConfig::resolve(
            &env(&[(ENV_MCP_CONFIG_FILES, ".mcp.json,/etc/mcp.json")]),
            Some(Path::new(HOME)),
            None,
        );
        assert_eq!(config.working_dir, None);
        assert_eq!(config.mcp_config_files, paths(&["/etc/mcp.json"]));
        assert!(config.skills_dirs.is_empty());
        assert_eq!(config.instructions_dirs, paths(&["/home/u/.ctxsync"]));
    }

    #[test]
    fn proto_form_carries_every_resolved_value() {
        let proto = resolve(&[]).to_proto();
        assert_eq!(proto.working_dir, WORK);
        assert_eq!(proto.instructions_dirs, vec!["/home/u/.ctxsync".to_owned()]);
        assert_eq!(
            proto.mcp_config_files,
            [
                "/work/ws/.mcp.json",
                "/work/ws/.vscode/mcp.json",
                "/work/ws/.cursor/mcp.json",
                "/work/ws/.roo/mcp.json"
            ]
        );
        assert_eq!(proto.skill_meta_file, "SKILL.md");
    }
}

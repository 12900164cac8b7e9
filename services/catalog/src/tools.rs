//! A server's catalog (its tool declarations and their hash) and the
//! comparison of a live catalog with a session's pin.

use std::collections::BTreeMap;

use ctxsync_proto::v1::McpTool;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tool {
    pub name: String,
    pub description: String,
    /// The tool's JSON Schema as the server sent it.
    pub input_schema_json: String,
}

impl Tool {
    /// Same name, description and schema; schemas compare as JSON values so
    /// key order or whitespace is not a change.
    pub fn same_declaration(&self, other: &Tool) -> bool {
        if self.name != other.name || self.description != other.description {
            return false;
        }
        if self.input_schema_json == other.input_schema_json {
            return true;
        }
        match (
            serde_json::from_str::<serde_json::Value>(&self.input_schema_json),
            serde_json::from_str::<serde_json::Value>(&other.input_schema_json),
        ) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        }
    }

    pub fn to_proto(&self) -> McpTool {
        McpTool {
            name: self.name.clone(),
            description: self.description.clone(),
            input_schema_json: self.input_schema_json.clone(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Catalog {
    pub tools: Vec<Tool>,
    pub hash: String,
}

impl Catalog {
    pub fn tool(&self, name: &str) -> Option<&Tool> {
        self.tools.iter().find(|t| t.name == name)
    }

    /// What changed from `self` (the pin) to `live`, by tool name.
    pub fn diff(&self, live: &Catalog) -> CatalogDiff {
        let pinned: BTreeMap<&str, &Tool> =
            self.tools.iter().map(|t| (t.name.as_str(), t)).collect();
        let current: BTreeMap<&str, &Tool> =
            live.tools.iter().map(|t| (t.name.as_str(), t)).collect();
        let mut diff = CatalogDiff::default();
        for (name, tool) in &pinned {
            match current.get(name) {
                None => diff.removed.push((*name).to_owned()),
                Some(now) if !tool.same_declaration(now) => diff.changed.push((*name).to_owned()),
                Some(_) => {}
            }
        }
        for name in current.keys() {
            if !pinned.contains_key(name) {
                diff.added.push((*name).to_owned());
            }
        }
        diff
    }
}

/// Tool names, sorted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CatalogDiff {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub changed: Vec<String>,
}

impl CatalogDiff {
    /// The pinned declaration of `tool` no longer holds.
    pub fn withdraws(&self, tool: &str) -> bool {
        self.removed.iter().any(|t| t == tool) || self.changed.iter().any(|t| t == tool)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str, description: &str, schema: &str) -> Tool {
        Tool {
            name: name.into(),
            description: description.into(),
            input_schema_json: schema.into(),
        }
    }

    #[test]
    fn diff_finds_added_removed_and_changed() {
        let pin = Catalog {
            tools: vec![
                tool("a", "A", r#"{"type":"object","properties":{}}"#),
                tool("b", "B", "{}"),
                tool("c", "C", "{}"),
            ],
            hash: "1".into(),
        };
        let live = Catalog {
            tools: vec![
                tool("a", "A", r#"{ "properties": {}, "type": "object" }"#),
                tool("c", "C changed", "{}"),
                tool("d", "D", "{}"),
            ],
            hash: "2".into(),
        };
        let diff = pin.diff(&live);
        assert_eq!(diff.added, ["d"]);
        assert_eq!(diff.removed, ["b"]);
        assert_eq!(diff.changed, ["c"]);
        assert!(!diff.withdraws("a"), "reordered schema keys are no change");
        assert!(diff.withdraws("b") && diff.withdraws("c") && !diff.withdraws("d"));
    }
}

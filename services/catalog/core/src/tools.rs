//! A server's catalog (its tool, prompt and resource declarations and their
//! hash) and the comparison of a live catalog with a session's pin.

use std::collections::BTreeMap;

use ctxsync_proto::v1::{CatalogPin, McpPrompt, McpResource, McpTool};

use crate::uri_template;

use crate::code::ItemKind;

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
        self.name == other.name
            && self.description == other.description
            && same_json(&self.input_schema_json, &other.input_schema_json)
    }

    pub fn to_proto(&self) -> McpTool {
        McpTool {
            name: self.name.clone(),
            description: self.description.clone(),
            input_schema_json: self.input_schema_json.clone(),
        }
    }
}

/// Two JSON texts say the same (key order and whitespace aside).
fn same_json(a: &str, b: &str) -> bool {
    a == b
        || matches!(
            (
                serde_json::from_str::<serde_json::Value>(a),
                serde_json::from_str::<serde_json::Value>(b),
            ),
            (Ok(a), Ok(b)) if a == b
        )
}

/// A declaration's JSON (null if it is not JSON).
fn parsed(declaration_json: &str) -> serde_json::Value {
    serde_json::from_str(declaration_json).unwrap_or_default()
}

/// A string field of a declaration; empty when absent or not a string.
fn json_field(declaration: &serde_json::Value, field: &str) -> String {
    declaration
        .get(field)
        .and_then(|f| f.as_str())
        .unwrap_or_default()
        .to_owned()
}

/// A prompt: its name and its whole declaration as the server listed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    pub name: String,
    pub declaration_json: String,
    /// From the declaration, read once: pins are built on every preparation.
    description: String,
}

impl Prompt {
    pub fn declared(name: String, declaration_json: String) -> Self {
        let declaration = parsed(&declaration_json);
        Self {
            description: json_field(&declaration, "description"),
            name,
            declaration_json,
        }
    }

    pub fn to_proto(&self) -> McpPrompt {
        McpPrompt {
            name: self.name.clone(),
            description: self.description.clone(),
            declaration_json: self.declaration_json.clone(),
        }
    }
}

/// A resource: its URI and its whole declaration as the server listed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resource {
    pub uri: String,
    pub declaration_json: String,
    /// From the declaration, read once.
    name: String,
    description: String,
    mime_type: String,
}

impl Resource {
    pub fn declared(uri: String, declaration_json: String) -> Self {
        let declaration = parsed(&declaration_json);
        Self {
            name: json_field(&declaration, "name"),
            description: json_field(&declaration, "description"),
            mime_type: json_field(&declaration, "mimeType"),
            uri,
            declaration_json,
        }
    }

    pub fn to_proto(&self) -> McpResource {
        McpResource {
            uri: self.uri.clone(),
            name: self.name.clone(),
            description: self.description.clone(),
            mime_type: self.mime_type.clone(),
            declaration_json: self.declaration_json.clone(),
            template: self.is_template(),
        }
    }

    /// A resource template, keyed by its URI template.
    pub fn is_template(&self) -> bool {
        uri_template::is_template(&self.uri)
    }
}

/// What a session may use of a server: the item a call names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Item<'a> {
    Tool(&'a str),
    Prompt(&'a str),
    /// By URI.
    Resource(&'a str),
}

impl<'a> Item<'a> {
    /// What the item is: for codes, messages and events.
    pub fn kind(self) -> ItemKind {
        match self {
            Self::Tool(_) => ItemKind::Tool,
            Self::Prompt(_) => ItemKind::Prompt,
            Self::Resource(_) => ItemKind::Resource,
        }
    }

    /// The tool's or prompt's name, or the resource's URI.
    pub fn key(self) -> &'a str {
        match self {
            Self::Tool(key) | Self::Prompt(key) | Self::Resource(key) => key,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Catalog {
    pub tools: Vec<Tool>,
    pub prompts: Vec<Prompt>,
    pub resources: Vec<Resource>,
    pub hash: String,
}

impl Catalog {
    pub fn tool(&self, name: &str) -> Option<&Tool> {
        self.tools.iter().find(|t| t.name == name)
    }

    /// A pin of this catalog: its hash and declarations (the caller adds
    /// the server, transport and source).
    pub fn to_pin(&self) -> CatalogPin {
        CatalogPin {
            catalog_hash: self.hash.clone(),
            tools: self.tools.iter().map(Tool::to_proto).collect(),
            prompts: self.prompts.iter().map(Prompt::to_proto).collect(),
            resources: self.resources.iter().map(Resource::to_proto).collect(),
            ..Default::default()
        }
    }

    /// Whether the catalog declares `item`.
    pub fn has(&self, item: Item<'_>) -> bool {
        match item {
            Item::Tool(name) => self.tool(name).is_some(),
            Item::Prompt(name) => self.prompts.iter().any(|p| p.name == name),
            Item::Resource(uri) => self.resource_key(uri).is_some(),
        }
    }

    /// The pinned resource a read of `uri` uses: the resource of that URI,
    /// else the first template `uri` expands.
    pub fn resource_key(&self, uri: &str) -> Option<&str> {
        let exact = self.resources.iter().find(|r| r.uri == uri);
        let templated = || {
            self.resources
                .iter()
                .find(|r| r.is_template() && uri_template::matches(&r.uri, uri))
        };
        exact.or_else(templated).map(|r| r.uri.as_str())
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
        diff.prompts = Changes::between(
            self.prompts
                .iter()
                .map(|p| (p.name.as_str(), p.declaration_json.as_str())),
            live.prompts
                .iter()
                .map(|p| (p.name.as_str(), p.declaration_json.as_str())),
        );
        diff.resources = Changes::between(
            self.resources
                .iter()
                .map(|r| (r.uri.as_str(), r.declaration_json.as_str())),
            live.resources
                .iter()
                .map(|r| (r.uri.as_str(), r.declaration_json.as_str())),
        );
        diff
    }
}

/// Prompts or resources removed or changed since the pin, by name (URI),
/// sorted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    pub removed: Vec<String>,
    pub changed: Vec<String>,
}

impl Changes {
    /// Items of `pinned` (key, declaration) gone from `live` or declared otherwise.
    fn between<'a>(
        pinned: impl Iterator<Item = (&'a str, &'a str)>,
        live: impl Iterator<Item = (&'a str, &'a str)>,
    ) -> Self {
        let live: BTreeMap<&str, &str> = live.collect();
        let pinned: BTreeMap<&str, &str> = pinned.collect();
        let mut changes = Self::default();
        for (key, declaration) in pinned {
            match live.get(key) {
                None => changes.removed.push(key.to_owned()),
                Some(now) if !same_json(declaration, now) => changes.changed.push(key.to_owned()),
                Some(_) => {}
            }
        }
        changes
    }

    fn withdraws(&self, key: &str) -> bool {
        self.removed.iter().any(|k| k == key) || self.changed.iter().any(|k| k == key)
    }

    fn removes(&self, key: &str) -> bool {
        self.removed.iter().any(|k| k == key)
    }

    /// A resource read of `uri` loses its pin: its resource, or a template
    /// it expands, is gone or changed. (A URI that expands a template and
    /// names a resource too is the resource's: `Catalog::resource_key`.)
    fn withdraws_uri(&self, uri: &str) -> bool {
        self.withdraws(uri)
            || self
                .removed
                .iter()
                .chain(&self.changed)
                .any(|key| templated(key, uri))
    }

    fn removes_uri(&self, uri: &str) -> bool {
        self.removes(uri) || self.removed.iter().any(|key| templated(key, uri))
    }
}

fn templated(key: &str, uri: &str) -> bool {
    uri_template::is_template(key) && uri_template::matches(key, uri)
}

/// Tool names, sorted; and the prompts and resources withdrawn.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CatalogDiff {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub changed: Vec<String>,
    pub prompts: Changes,
    pub resources: Changes,
}

impl CatalogDiff {
    /// The pinned declaration of `tool` no longer holds.
    pub fn withdraws(&self, tool: &str) -> bool {
        self.removed.iter().any(|t| t == tool) || self.changed.iter().any(|t| t == tool)
    }

    /// The pinned declaration of `item` no longer holds.
    pub fn withdraws_item(&self, item: Item<'_>) -> bool {
        match item {
            Item::Tool(name) => self.withdraws(name),
            Item::Prompt(name) => self.prompts.withdraws(name),
            Item::Resource(uri) => self.resources.withdraws_uri(uri),
        }
    }

    /// `item` is gone from the server (not merely changed).
    pub fn removes_item(&self, item: Item<'_>) -> bool {
        match item {
            Item::Tool(name) => self.removed.iter().any(|t| t == name),
            Item::Prompt(name) => self.prompts.removes(name),
            Item::Resource(uri) => self.resources.removes_uri(uri),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(name: &str, declaration: &str) -> Prompt {
        Prompt::declared(name.into(), declaration.into())
    }

    fn resource(uri: &str) -> Resource {
        Resource::declared(uri.into(), format!(r#"{{"uri":"{uri}","name":"r"}}"#))
    }

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
            prompts: vec![
                prompt("kept", r#"{"name":"kept","description":"k"}"#),
                prompt("gone", r#"{"name":"gone"}"#),
                prompt("edited", r#"{"name":"edited","description":"old"}"#),
            ],
            resources: vec![resource("a://1"), resource("a://2")],
            hash: "1".into(),
        };
        let live = Catalog {
            tools: vec![
                tool("a", "A", r#"{ "properties": {}, "type": "object" }"#),
                tool("c", "C changed", "{}"),
                tool("d", "D", "{}"),
            ],
            prompts: vec![
                prompt("kept", r#"{ "description": "k", "name": "kept" }"#),
                prompt("edited", r#"{"name":"edited","description":"new"}"#),
                prompt("new", r#"{"name":"new"}"#),
            ],
            resources: vec![resource("a://2"), resource("a://3")],
            hash: "2".into(),
        };
        let diff = pin.diff(&live);
        assert_eq!(diff.added, ["d"]);
        assert_eq!(diff.removed, ["b"]);
        assert_eq!(diff.changed, ["c"]);
        assert!(!diff.withdraws("a"), "reordered schema keys are no change");
        assert!(diff.withdraws("b") && diff.withdraws("c") && !diff.withdraws("d"));
        assert_eq!(diff.prompts.removed, ["gone"]);
        assert_eq!(diff.prompts.changed, ["edited"]);
        assert!(
            !diff.withdraws_item(Item::Prompt("kept")),
            "reordered keys are no change"
        );
        assert!(
            !diff.withdraws_item(Item::Prompt("new")),
            "added since the pin: not withdrawn"
        );
        assert!(
            diff.removes_item(Item::Prompt("gone")) && !diff.removes_item(Item::Prompt("edited"))
        );
        assert_eq!(diff.resources.removed, ["a://1"]);
        assert!(diff.withdraws_item(Item::Resource("a://1")));
        assert!(!diff.withdraws_item(Item::Resource("a://2")));
        assert!(diff.withdraws_item(Item::Tool("b")) && !diff.withdraws_item(Item::Tool("a")));
    }

    #[test]
    fn proto_fields_come_from_the_declaration() {
        let r = Resource::declared(
            "a://1".into(),
            r#"{"uri":"a://1","name":"one","mimeType":"text/plain"}"#.into(),
        );
        let proto = r.to_proto();
        assert_eq!(
            (proto.name.as_str(), proto.mime_type.as_str()),
            ("one", "text/plain")
        );
        assert_eq!(proto.description, "");
        let p = prompt("p", r#"{"name":"p","description":"says hi"}"#);
        assert_eq!(p.to_proto().description, "says hi");
    }
}

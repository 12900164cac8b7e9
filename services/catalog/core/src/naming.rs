//! The names MCP clients see for a server's tools and prompts: the tenant's
//! strategy (`prefix`, `server__tool`, the default; or `bare`, the server's
//! own names), a server's own prefix, and aliases for single items.
//!
//! A session's pin keeps the rule it was made with, so its names never
//! change under it when the configuration does. Two servers offering one
//! name is a collision: the configuration is refused when it is known at
//! load, and a live discovery that brings one reports it while the earlier
//! server (in configured order) keeps the name.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use ctxsync_proto::v1::catalog_pin::Source;
use ctxsync_proto::v1::{CatalogPin, NamingRule};

use crate::code::ItemKind;
use crate::tools::Catalog;

/// Between a prefix and the server's own name.
pub const SEPARATOR: &str = "__";

/// How one server's items are named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NameRule {
    /// Put before each name with [`SEPARATOR`]; `None` keeps the server's
    /// own names.
    pub prefix: Option<String>,
    /// The server's own name of a tool or prompt → the name offered.
    pub aliases: BTreeMap<String, String>,
}

impl NameRule {
    /// `server__name`: the rule of a pin stored before rules were kept.
    pub fn prefixed(prefix: &str) -> Self {
        Self {
            prefix: Some(prefix.to_owned()),
            aliases: BTreeMap::new(),
        }
    }

    pub fn bare() -> Self {
        Self {
            prefix: None,
            aliases: BTreeMap::new(),
        }
    }

    /// The name a client sees for the server's `name`.
    pub fn offered(&self, name: &str) -> String {
        if let Some(alias) = self.aliases.get(name) {
            return alias.clone();
        }
        match &self.prefix {
            Some(prefix) => format!("{prefix}{SEPARATOR}{name}"),
            None => name.to_owned(),
        }
    }

    /// Whether resource URIs are the server's own and compete with other
    /// bare servers' (a prefixed server's URIs are its own too, but served
    /// first-configured-wins as before rules existed).
    pub fn is_bare(&self) -> bool {
        self.prefix.is_none()
    }

    pub fn to_proto(&self) -> NamingRule {
        NamingRule {
            prefix: self.prefix.clone().unwrap_or_default(),
            bare: self.prefix.is_none(),
            aliases: self.aliases.clone().into_iter().collect(),
        }
    }

    /// A pin's rule; a pin without one (made before rules existed) is
    /// prefixed with its server id.
    pub fn of_pin(rule: Option<&NamingRule>, server_id: &str) -> Self {
        match rule {
            None => Self::prefixed(server_id),
            Some(rule) => Self {
                prefix: (!rule.bare).then(|| rule.prefix.clone()),
                aliases: rule
                    .aliases
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
            },
        }
    }

    /// As the pins table stores it.
    pub fn to_json(&self) -> String {
        serde_json::json!({ "prefix": self.prefix, "aliases": self.aliases }).to_string()
    }

    /// A stored rule; `None` (a pin stored before rules existed, or text
    /// that does not parse) is prefixed with the server id.
    pub fn from_json(text: Option<&str>, server_id: &str) -> Self {
        #[derive(serde::Deserialize)]
        struct Stored {
            prefix: Option<String>,
            #[serde(default)]
            aliases: BTreeMap<String, String>,
        }
        match text.map(serde_json::from_str::<Stored>) {
            Some(Ok(stored)) => Self {
                prefix: stored.prefix,
                aliases: stored.aliases,
            },
            _ => Self::prefixed(server_id),
        }
    }
}

/// Two servers of one tenant offering one name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Collision {
    pub kind: ItemKind,
    pub name: String,
    /// The server that keeps the name (earlier in configured order).
    pub first: String,
    pub second: String,
}

impl fmt::Display for Collision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = if self.kind == ItemKind::Resource {
            "resource uri"
        } else {
            self.kind.as_str()
        };
        write!(
            f,
            "servers {:?} and {:?} both offer the {what} {:?}",
            self.first, self.second, self.name
        )
    }
}

/// The names a server declared, as the collision check reads them.
#[derive(Debug, Clone, Default)]
pub struct Declared<'a> {
    pub tools: Vec<&'a str>,
    pub prompts: Vec<&'a str>,
    pub resources: Vec<&'a str>,
}

impl<'a> Declared<'a> {
    pub fn of_catalog(catalog: &'a Catalog) -> Self {
        Self {
            tools: catalog.tools.iter().map(|t| t.name.as_str()).collect(),
            prompts: catalog.prompts.iter().map(|p| p.name.as_str()).collect(),
            resources: catalog.resources.iter().map(|r| r.uri.as_str()).collect(),
        }
    }

    pub fn of_pin(pin: &'a CatalogPin) -> Self {
        Self {
            tools: pin.tools.iter().map(|t| t.name.as_str()).collect(),
            prompts: pin.prompts.iter().map(|p| p.name.as_str()).collect(),
            resources: pin.resources.iter().map(|r| r.uri.as_str()).collect(),
        }
    }
}

/// One server as the collision check sees it: its id, rule, and declared
/// names when they are known.
pub struct Named<'a> {
    pub server_id: &'a str,
    pub rule: &'a NameRule,
    pub declared: Option<Declared<'a>>,
}

/// Every collision among `servers` (in configured order): equal prefixes,
/// equal alias targets, and, where declarations are known, equal offered
/// names of tools, of prompts, and of bare servers' resource URIs.
pub fn collisions(servers: &[Named<'_>]) -> Vec<Collision> {
    let mut found = Vec::new();
    let mut seen: HashMap<(ItemKind, String), String> = HashMap::new();
    let mut note =
        |kind: ItemKind, name: String, server: &str, found: &mut Vec<Collision>| match seen
            .get(&(kind, name.clone()))
        {
            Some(first) if first != server => found.push(Collision {
                kind,
                name,
                first: first.clone(),
                second: server.to_owned(),
            }),
            Some(_) => {}
            None => {
                seen.insert((kind, name), server.to_owned());
            }
        };
    let mut prefixes: HashMap<&str, &str> = HashMap::new();
    for server in servers {
        if let Some(prefix) = &server.rule.prefix
            && let Some(first) = prefixes.insert(prefix, server.server_id)
        {
            found.push(Collision {
                kind: ItemKind::Tool,
                name: format!("{prefix}{SEPARATOR}*"),
                first: first.to_owned(),
                second: server.server_id.to_owned(),
            });
        }
        match &server.declared {
            Some(declared) => {
                for tool in &declared.tools {
                    let name = server.rule.offered(tool);
                    note(ItemKind::Tool, name, server.server_id, &mut found);
                }
                for prompt in &declared.prompts {
                    let name = server.rule.offered(prompt);
                    note(ItemKind::Prompt, name, server.server_id, &mut found);
                }
                if server.rule.is_bare() {
                    for uri in &declared.resources {
                        note(
                            ItemKind::Resource,
                            (*uri).to_owned(),
                            server.server_id,
                            &mut found,
                        );
                    }
                }
            }
            // Unknown items: their alias targets are the names known to be
            // offered (as a tool or a prompt, so checked as both).
            None => {
                for alias in server.rule.aliases.values() {
                    for kind in [ItemKind::Tool, ItemKind::Prompt] {
                        note(kind, alias.clone(), server.server_id, &mut found);
                    }
                }
            }
        }
    }
    found.dedup_by(|a, b| a.name == b.name && a.first == b.first && a.second == b.second);
    found
}

/// Marks on each pin the names it loses to an earlier pin (the earlier
/// keeps them), and answers the collisions.
pub fn mark_pins(pins: &mut [CatalogPin]) -> Vec<Collision> {
    let rules: Vec<NameRule> = pins
        .iter()
        .map(|pin| NameRule::of_pin(pin.naming.as_ref(), &pin.server_id))
        .collect();
    let found = {
        let named: Vec<Named<'_>> = pins
            .iter()
            .zip(&rules)
            .filter(|(pin, _)| pin.source() != Source::Failed)
            .map(|(pin, rule)| Named {
                server_id: &pin.server_id,
                rule,
                declared: Some(Declared::of_pin(pin)),
            })
            .collect();
        collisions(&named)
    };
    for collision in &found {
        if let Some(pin) = pins.iter_mut().find(|p| p.server_id == collision.second) {
            pin.name_collisions.push(collision.to_string());
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::Tool;

    fn catalog(tools: &[&str]) -> Catalog {
        Catalog {
            tools: tools
                .iter()
                .map(|name| Tool {
                    name: (*name).to_owned(),
                    description: String::new(),
                    input_schema_json: "{}".to_owned(),
                })
                .collect(),
            prompts: Vec::new(),
            resources: Vec::new(),
            hash: "h".to_owned(),
        }
    }

    #[test]
    fn offered_names_follow_the_rule() {
        let mut rule = NameRule::bare();
        assert_eq!(rule.offered("echo"), "echo");
        rule.aliases.insert("echo".into(), "say".into());
        assert_eq!(rule.offered("echo"), "say");
        assert_eq!(NameRule::prefixed("gh").offered("echo"), "gh__echo");
    }

    #[test]
    fn a_pin_keeps_its_rule_through_proto_and_json() {
        let mut rule = NameRule::bare();
        rule.aliases.insert("a".into(), "b".into());
        assert_eq!(NameRule::of_pin(Some(&rule.to_proto()), "s"), rule);
        assert_eq!(NameRule::from_json(Some(&rule.to_json()), "s"), rule);
        let prefixed = NameRule::prefixed("gh");
        assert_eq!(NameRule::of_pin(Some(&prefixed.to_proto()), "s"), prefixed);
        assert_eq!(NameRule::of_pin(None, "s"), NameRule::prefixed("s"));
        assert_eq!(NameRule::from_json(None, "s"), NameRule::prefixed("s"));
    }

    #[test]
    fn bare_servers_with_one_tool_name_collide_naming_both() {
        let (a, b) = (catalog(&["echo", "add"]), catalog(&["echo"]));
        let bare = NameRule::bare();
        let found = collisions(&[
            Named {
                server_id: "one",
                rule: &bare,
                declared: Some(Declared::of_catalog(&a)),
            },
            Named {
                server_id: "two",
                rule: &bare,
                declared: Some(Declared::of_catalog(&b)),
            },
        ]);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(
            found[0].to_string(),
            "servers \"one\" and \"two\" both offer the tool \"echo\""
        );
    }

    #[test]
    fn prefixes_and_aliases_keep_names_apart_or_collide() {
        let (a, b) = (catalog(&["echo"]), catalog(&["echo"]));
        let (one, two) = (NameRule::prefixed("one"), NameRule::prefixed("two"));
        let apart = [
            Named {
                server_id: "one",
                rule: &one,
                declared: Some(Declared::of_catalog(&a)),
            },
            Named {
                server_id: "two",
                rule: &two,
                declared: Some(Declared::of_catalog(&b)),
            },
        ];
        assert!(collisions(&apart).is_empty());

        let mut aliased = NameRule::bare();
        aliased.aliases.insert("x".into(), "one__echo".into());
        let alias_hits_prefix = [
            Named {
                server_id: "one",
                rule: &one,
                declared: Some(Declared::of_catalog(&a)),
            },
            Named {
                server_id: "three",
                rule: &aliased,
                declared: None,
            },
        ];
        let found = collisions(&alias_hits_prefix);
        assert_eq!(found[0].name, "one__echo");
        assert_eq!(
            (found[0].first.as_str(), found[0].second.as_str()),
            ("one", "three")
        );

        let same_prefix = [
            Named {
                server_id: "one",
                rule: &one,
                declared: None,
            },
            Named {
                server_id: "other",
                rule: &one,
                declared: None,
            },
        ];
        assert_eq!(collisions(&same_prefix)[0].name, "one__*");
    }
}

//! Whether a URI is one a server's resource template (RFC 6570) declares:
//! a read of a URI no resource has goes to the server whose template it
//! matches. A template is pinned like a resource, keyed by its template
//! text (which holds `{`, a character no URI has, so the keys never meet).
//!
//! Matching reads the expressions the MCP servers in use write: `{var}`
//! (one path segment's worth: no `/`, `?` or `#`), `{+var}` and `{#var}`
//! (reserved: anything), `{/var}` (`/` then a segment), `{.var}`, `{;var}`,
//! `{?a,b}` and `{&a}` (the rest of the query). Literal text must match
//! exactly.

/// Whether `text` is a URI template rather than a URI.
pub fn is_template(text: &str) -> bool {
    text.contains('{')
}

/// Whether `uri` is an expansion of `template`.
pub fn matches(template: &str, uri: &str) -> bool {
    match parse(template) {
        Some(parts) => match_parts(&parts, uri),
        None => false,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part<'a> {
    Literal(&'a str),
    /// Anything but the characters that end a simple value.
    Simple,
    /// Reserved expansion: any text.
    Reserved,
    /// `{/var}`, `{.var}`, `{;var}`: the operator, then a simple value.
    Prefixed(char),
    /// `{?..}`, `{&..}`: the rest of the query, or nothing.
    Query,
}

fn parse(template: &str) -> Option<Vec<Part<'_>>> {
    let mut parts = Vec::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        if open > 0 {
            parts.push(Part::Literal(&rest[..open]));
        }
        let close = rest[open..].find('}')? + open;
        let expression = &rest[open + 1..close];
        parts.push(match expression.chars().next()? {
            '+' | '#' => Part::Reserved,
            op @ ('/' | '.' | ';') => Part::Prefixed(op),
            '?' | '&' => Part::Query,
            _ => Part::Simple,
        });
        rest = &rest[close + 1..];
    }
    if !rest.is_empty() {
        parts.push(Part::Literal(rest));
    }
    Some(parts)
}

fn ends_simple(c: char) -> bool {
    matches!(c, '/' | '?' | '#')
}

/// Backtracking over the parts: templates have a handful of expressions.
fn match_parts(parts: &[Part<'_>], uri: &str) -> bool {
    let Some((first, rest)) = parts.split_first() else {
        return uri.is_empty();
    };
    match *first {
        Part::Literal(text) => uri
            .strip_prefix(text)
            .is_some_and(|left| match_parts(rest, left)),
        Part::Simple => {
            let longest = uri.find(ends_simple).unwrap_or(uri.len());
            (1..=longest).rev().any(|n| match_parts(rest, &uri[n..]))
        }
        Part::Reserved => (0..=uri.len())
            .rev()
            .filter(|n| uri.is_char_boundary(*n))
            .any(|n| match_parts(rest, &uri[n..])),
        Part::Prefixed(op) => {
            let Some(left) = uri.strip_prefix(op) else {
                return match_parts(rest, uri);
            };
            let longest = left.find(ends_simple).unwrap_or(left.len());
            (0..=longest).rev().any(|n| match_parts(rest, &left[n..]))
        }
        Part::Query => {
            (uri.is_empty() || uri.starts_with('?') || uri.starts_with('&'))
                && (0..=uri.len())
                    .rev()
                    .filter(|n| uri.is_char_boundary(*n))
                    .any(|n| match_parts(rest, &uri[n..]))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simple_values_fill_one_segment() {
        let template = "test://static/resource/{id}";
        assert!(matches(template, "test://static/resource/1"));
        assert!(matches(template, "test://static/resource/abc"));
        assert!(!matches(template, "test://static/resource/"));
        assert!(!matches(template, "test://static/resource/1/2"));
        assert!(!matches(template, "test://other/1"));
        assert!(matches("file:///{dir}/{name}.txt", "file:///a/b.txt"));
        assert!(!matches("file:///{dir}/{name}.txt", "file:///a/b.json"));
    }

    #[test]
    fn reserved_and_query_expressions_take_the_rest() {
        assert!(matches("file://{+path}", "file:///etc/hosts"));
        assert!(matches(
            "api://items{?page,size}",
            "api://items?page=2&size=9"
        ));
        assert!(matches("api://items{?page}", "api://items"));
        assert!(matches("repo://{owner}{/name}", "repo://me/project"));
    }

    #[test]
    fn templates_are_told_from_uris() {
        assert!(is_template("test://{id}"));
        assert!(!is_template("test://static/1"));
        assert!(!matches("test://{id", "test://x"));
    }
}

//! Reads the subset of the NATS server config format that `deploy/k8s/nats/nats.conf`
//! uses: maps (`{}`), arrays (`[]`), `key: value` / `key = value` / `key value`,
//! quoted and bare strings, `true`/`false`, `$VARIABLE` references, and `#` or
//! `//` comments. Variables are kept as `"$NAME"` strings. The server itself
//! (`nats-server -t`) is the authority on validity; this exists so tests can
//! compare the permissions with the subjects the code uses.

use serde_json::{Map, Value};

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Open,
    Close,
    OpenList,
    CloseList,
    Comma,
    Separator,
    Word(String),
    Quoted(String),
}

fn tokenize(text: &str) -> Result<Vec<Token>, String> {
    let mut tokens = Vec::new();
    let mut chars = text.chars().peekable();
    while let Some(&c) = chars.peek() {
        match c {
            c if c.is_whitespace() => {
                chars.next();
            }
            '#' => skip_line(&mut chars),
            '/' => {
                chars.next();
                if chars.peek() == Some(&'/') {
                    skip_line(&mut chars);
                } else {
                    return Err("a lone '/'".into());
                }
            }
            '{' | '}' | '[' | ']' | ',' | ':' | '=' => {
                chars.next();
                tokens.push(match c {
                    '{' => Token::Open,
                    '}' => Token::Close,
                    '[' => Token::OpenList,
                    ']' => Token::CloseList,
                    ',' => Token::Comma,
                    _ => Token::Separator,
                });
            }
            '"' | '\'' => {
                let quote = c;
                chars.next();
                let mut s = String::new();
                loop {
                    match chars.next() {
                        None => return Err("an unterminated string".into()),
                        Some('\\') => s.extend(chars.next()),
                        Some(ch) if ch == quote => break,
                        Some(ch) => s.push(ch),
                    }
                }
                tokens.push(Token::Quoted(s));
            }
            _ => {
                let mut word = String::new();
                while let Some(&ch) = chars.peek() {
                    if ch.is_whitespace() || "{}[],:=#\"'".contains(ch) {
                        break;
                    }
                    word.push(ch);
                    chars.next();
                }
                tokens.push(Token::Word(word));
            }
        }
    }
    Ok(tokens)
}

fn skip_line(chars: &mut std::iter::Peekable<std::str::Chars<'_>>) {
    for ch in chars.by_ref() {
        if ch == '\n' {
            break;
        }
    }
}

/// Parses a NATS config text into a JSON value (the top level is a map).
pub fn parse(text: &str) -> Result<Value, String> {
    let tokens = tokenize(text)?;
    let mut position = 0;
    let map = parse_map(&tokens, &mut position, false)?;
    Ok(Value::Object(map))
}

fn parse_map(tokens: &[Token], at: &mut usize, nested: bool) -> Result<Map<String, Value>, String> {
    let mut map = Map::new();
    loop {
        while tokens.get(*at) == Some(&Token::Comma) {
            *at += 1;
        }
        match tokens.get(*at) {
            None if nested => return Err("a map is not closed".into()),
            None => return Ok(map),
            Some(Token::Close) if nested => {
                *at += 1;
                return Ok(map);
            }
            Some(Token::Word(key)) | Some(Token::Quoted(key)) => {
                *at += 1;
                if tokens.get(*at) == Some(&Token::Separator) {
                    *at += 1;
                }
                let value = parse_value(tokens, at)?;
                if map.insert(key.clone(), value).is_some() {
                    return Err(format!("key {key:?} appears twice"));
                }
            }
            Some(other) => return Err(format!("unexpected {other:?} where a key belongs")),
        }
    }
}

fn parse_value(tokens: &[Token], at: &mut usize) -> Result<Value, String> {
    let token = tokens.get(*at).ok_or("a value is missing")?;
    *at += 1;
    Ok(match token {
        Token::Open => Value::Object(parse_map(tokens, at, true)?),
        Token::OpenList => {
            let mut items = Vec::new();
            loop {
                while tokens.get(*at) == Some(&Token::Comma) {
                    *at += 1;
                }
                if tokens.get(*at) == Some(&Token::CloseList) {
                    *at += 1;
                    break;
                }
                items.push(parse_value(tokens, at)?);
            }
            Value::Array(items)
        }
        Token::Quoted(s) => Value::String(s.clone()),
        Token::Word(w) if w == "true" => Value::Bool(true),
        Token::Word(w) if w == "false" => Value::Bool(false),
        Token::Word(w) => Value::String(w.clone()),
        other => return Err(format!("unexpected {other:?} where a value belongs")),
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_maps_lists_variables_and_comments() {
        let value = super::parse(
            "# c\nport: 4222\nauth { users = [\n {user: \"a\", password: $P // c\n ok: true}\n] }\n",
        )
        .unwrap();
        assert_eq!(value["port"], "4222");
        assert_eq!(value["auth"]["users"][0]["user"], "a");
        assert_eq!(value["auth"]["users"][0]["password"], "$P");
        assert_eq!(value["auth"]["users"][0]["ok"], true);
        assert!(super::parse("a { b: 1").is_err());
        assert!(super::parse("a: 1\na: 2").is_err());
    }
}

//! Text hygiene for what a server says about itself: tool names and
//! descriptions, error messages, stderr. A server may write anything there,
//! NUL included, and Postgres `text` (and `jsonb`) refuses NUL: one such
//! byte would fail every write that carries it. So everything a server says
//! is cleaned before it leaves this crate.

use std::borrow::Cow;

/// `text` without control characters, keeping `\n` and `\t`:
/// * ANSI escape sequences (colours, cursor moves: `ESC [ … final byte`,
///   `ESC ] … BEL`, `ESC` + one byte) are dropped: they mean nothing outside
///   a terminal;
/// * `\r\n` and a lone `\r` become `\n`;
/// * every other control character (C0, DEL, C1; NUL among them) becomes
///   U+FFFD, so the text still shows that something was there.
///
/// Text that needs none of this is returned borrowed.
pub fn clean_text(text: &str) -> Cow<'_, str> {
    if !text.chars().any(needs_cleaning) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\n' | '\t' => out.push(c),
            '\r' => {
                if chars.peek() != Some(&'\n') {
                    out.push('\n');
                }
            }
            '\u{1b}' => skip_escape_sequence(&mut chars),
            c if c.is_control() => out.push(char::REPLACEMENT_CHARACTER),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// Cleans `text` in place (see [`clean_text`]); allocates only when it changes.
pub fn clean_string(text: &mut String) {
    if let Cow::Owned(cleaned) = clean_text(text) {
        *text = cleaned;
    }
}

fn needs_cleaning(c: char) -> bool {
    c.is_control() && c != '\n' && c != '\t'
}

/// Consumes the rest of an escape sequence whose ESC was just read.
fn skip_escape_sequence(chars: &mut std::iter::Peekable<std::str::Chars<'_>>) {
    match chars.peek() {
        // CSI: parameter and intermediate bytes, then one final byte.
        Some('[') => {
            chars.next();
            for c in chars.by_ref() {
                if ('\u{40}'..='\u{7e}').contains(&c) {
                    break;
                }
                if !('\u{20}'..='\u{3f}').contains(&c) {
                    // Not a CSI after all: stop without eating more text.
                    break;
                }
            }
        }
        // OSC (e.g. a window title): up to BEL or ESC \.
        Some(']') => {
            chars.next();
            while let Some(c) = chars.next() {
                if c == '\u{7}' {
                    break;
                }
                if c == '\u{1b}' {
                    if chars.peek() == Some(&'\\') {
                        chars.next();
                    }
                    break;
                }
            }
        }
        // A charset pick: ESC ( B and the like.
        Some('(' | ')' | '*' | '+') => {
            chars.next();
            chars.next();
        }
        // A two-byte sequence: ESC + one of @A–Z\^_.
        Some(c) if ('\u{40}'..='\u{5f}').contains(c) => {
            chars.next();
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_text_is_borrowed_untouched() {
        let text = "line one\n\ttabbed — ünïcode 🦀";
        assert!(matches!(clean_text(text), Cow::Borrowed(t) if t == text));
    }

    #[test]
    fn nul_and_other_controls_become_replacement_characters() {
        assert_eq!(
            clean_text("a\0b\u{1}c\u{7f}d\u{85}e"),
            "a\u{fffd}b\u{fffd}c\u{fffd}d\u{fffd}e"
        );
        assert_eq!(clean_text("\0\0\0"), "\u{fffd}\u{fffd}\u{fffd}");
    }

    #[test]
    fn carriage_returns_become_newlines() {
        assert_eq!(clean_text("a\r\nb\rc"), "a\nb\nc");
    }

    #[test]
    fn ansi_sequences_are_dropped() {
        assert_eq!(
            clean_text("\u{1b}[1;31merror\u{1b}[0m: \u{1b}]0;title\u{7}boom\u{1b}(B"),
            "error: boom"
        );
        // A lone ESC at the end, or before ordinary text, just goes.
        assert_eq!(clean_text("x\u{1b}"), "x");
        assert_eq!(clean_text("\u{1b}hello"), "hello");
    }

    #[test]
    fn clean_string_changes_only_what_needs_it() {
        let mut text = String::from("fine");
        let before = text.as_ptr();
        clean_string(&mut text);
        assert_eq!(text.as_ptr(), before, "no reallocation for clean text");
        let mut text = String::from("not\0fine");
        clean_string(&mut text);
        assert_eq!(text, "not\u{fffd}fine");
    }
}

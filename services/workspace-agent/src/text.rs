//! Small text helpers that keep what the agent sends within the ingest limits.

/// Cuts `text` to at most `max` bytes on a char boundary, marking the cut.
pub fn clamp(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    const MARK: &str = "… [truncated]";
    let keep = floor_char_boundary(text, max.saturating_sub(MARK.len()));
    format!("{}{MARK}", &text[..keep])
}

/// The largest char boundary at or below `index`.
pub fn floor_char_boundary(text: &str, index: usize) -> usize {
    if index >= text.len() {
        return text.len();
    }
    let mut i = index;
    while !text.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clamp_keeps_short_text_and_cuts_long_text_on_a_char_boundary() {
        assert_eq!(clamp("short", 10), "short");
        let long = "é".repeat(100);
        let cut = clamp(&long, 50);
        assert!(cut.len() <= 50, "{} bytes", cut.len());
        assert!(cut.ends_with("[truncated]"));
        assert!(cut.starts_with('é'));
    }
}

//! Number and string formatting shared by every writer, so a field has one precision wherever
//! it appears and no writer can print `-0.0`, `NaN` inside JSON, or a model name that splits a
//! `key=value` line.

/// `x` with `decimals` digits after the point. Non-finite values print as `nan` (the CSV
/// readers parse it back as NaN); a value that rounds to zero never prints a minus sign.
pub fn fixed(x: f64, decimals: usize) -> String {
    if !x.is_finite() {
        return "nan".to_string();
    }
    let s = format!("{x:.decimals$}");
    strip_negative_zero(s)
}

/// Like `fixed`, for JSON: a non-finite value prints as `-1`, the contract's "unmeasured"
/// sentinel, because JSON has no NaN.
pub fn json_fixed(x: f64, decimals: usize) -> String {
    if !x.is_finite() {
        return "-1".to_string();
    }
    fixed(x, decimals)
}

fn strip_negative_zero(s: String) -> String {
    match s.strip_prefix('-') {
        Some(rest) if rest.bytes().all(|b| b == b'0' || b == b'.') => rest.to_string(),
        _ => s,
    }
}

/// `x` with at most four significant digits and no trailing zeros (C's `%.4g`): `0.75`, `1`,
/// `0.95`, `1.5e-05`. Used for the preamble's fractional knobs.
pub fn g4(x: f64) -> String {
    if !x.is_finite() {
        return "nan".to_string();
    }
    if x == 0.0 {
        return "0".to_string();
    }
    let exponent = x.abs().log10().floor() as i32;
    if (-4..4).contains(&exponent) {
        let decimals = (3 - exponent).max(0) as usize;
        trim_fraction(fixed(x, decimals))
    } else {
        let s = format!("{x:.3e}");
        match s.split_once('e') {
            Some((mantissa, exp)) => {
                let mantissa = trim_fraction(mantissa.to_string());
                let (sign, digits) = match exp.strip_prefix('-') {
                    Some(d) => ("-", d),
                    None => ("+", exp),
                };
                format!("{mantissa}e{sign}{digits:0>2}")
            }
            None => s,
        }
    }
}

fn trim_fraction(s: String) -> String {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// `s` as a JSON string literal, quotes included.
pub fn json_str(s: &str) -> String {
    // serde_json escapes quotes, backslashes and every control character; it cannot fail on
    // a &str, and if it ever did an empty literal is the safe answer.
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_string())
}

/// `s` with every whitespace character replaced by `_`, so it stays one token on a
/// whitespace-separated `key=value` line. Empty becomes `unknown`.
pub fn kv_token(s: &str) -> String {
    if s.is_empty() {
        return "unknown".to_string();
    }
    s.chars()
        .map(|c| if c.is_whitespace() { '_' } else { c })
        .collect()
}

/// `0`/`1` for a flag.
pub fn bit(b: bool) -> u8 {
    u8::from(b)
}

/// Bytes to MiB.
pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

/// `num / den` as a percentage, 0 when the denominator is 0.
pub fn pct(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        100.0 * num as f64 / den as f64
    }
}

/// Splits a `#` comment line's body into `key=value` pairs. `None` when a token has no `=`
/// (a free-form comment such as `# note: ...`).
pub fn parse_key_values(body: &str) -> Option<Vec<(String, String)>> {
    let mut out = Vec::new();
    for token in body.split_whitespace() {
        let (k, v) = token.split_once('=')?;
        if k.is_empty() {
            return None;
        }
        out.push((k.to_string(), v.to_string()));
    }
    Some(out)
}

/// An error and its causes on one line, `outer: cause: root`, each said once: a cause whose
/// text the line already holds is skipped. Many error types both print their source in their
/// message and return it from `source()`; printing the whole chain blindly (`{:#}`) would then
/// say the OS error twice.
pub fn error_text(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let t = c.to_string();
        if !t.is_empty() && !text.contains(&t) {
            text.push_str(": ");
            text.push_str(&t);
        }
        cause = c.source();
    }
    text
}

#[cfg(test)]
mod tests {
    #[derive(Debug, thiserror::Error)]
    #[error("{file}: cannot open: {source}")]
    struct Open {
        file: String,
        source: std::io::Error,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("loading the model")]
    struct Context {
        #[source]
        source: Open,
    }

    #[test]
    fn error_text_says_each_cause_once() {
        let e = Context {
            source: Open {
                file: "/m".into(),
                source: std::io::Error::from_raw_os_error(19),
            },
        };
        let t = super::error_text(&e);
        assert_eq!(t.matches("os error 19").count(), 1, "{t}");
        assert!(t.starts_with("loading the model: /m: cannot open: "), "{t}");
    }

    use super::*;

    #[test]
    fn fixed_has_no_negative_zero() {
        assert_eq!(fixed(-0.0, 1), "0.0");
        assert_eq!(fixed(-0.00001, 3), "0.000");
        assert_eq!(fixed(-0.5, 1), "-0.5");
        assert_eq!(fixed(2.25, 1), "2.2");
        assert_eq!(fixed(f64::NAN, 2), "nan");
        assert_eq!(json_fixed(f64::INFINITY, 2), "-1");
    }

    #[test]
    fn g4_matches_percent_g() {
        for (x, want) in [
            (0.75, "0.75"),
            (0.0, "0"),
            (1.0, "1"),
            (0.95, "0.95"),
            (0.15000000596046448, "0.15"),
            (12.5, "12.5"),
            (1234.5678, "1235"),
            (0.00015, "0.00015"),
            (0.000015, "1.5e-05"),
            (12345.0, "1.234e+04"),
            (-0.5, "-0.5"),
        ] {
            assert_eq!(g4(x), want, "{x}");
        }
    }

    #[test]
    fn json_and_tokens() {
        assert_eq!(json_str("a\"b\\c\nd\te\u{1}"), r#""a\"b\\c\nd\te\u0001""#);
        assert_eq!(kv_token("my model.gguf"), "my_model.gguf");
        assert_eq!(kv_token(""), "unknown");
        assert_eq!(
            parse_key_values("a=1 b=x"),
            Some(vec![("a".into(), "1".into()), ("b".into(), "x".into())])
        );
        assert_eq!(parse_key_values("note: free text"), None);
    }
}

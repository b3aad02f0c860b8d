//! Python's `json.dumps` over template values, byte for byte: the separators
//! `", "`/`": "` (`","` between items once indenting), `\uXXXX` escapes in
//! lowercase hex with surrogate pairs, non-ASCII kept unless `ensure_ascii`,
//! floats as Python's `repr`, `NaN`/`Infinity`, non-string keys turned to
//! strings (Python's `json` module documentation and `json/encoder.py`).

use std::fmt::Write;

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

#[derive(Clone, Debug)]
pub(super) struct DumpOptions {
    ensure_ascii: bool,
    /// The text one nesting level adds, or `None` for everything on one line.
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
}

impl DumpOptions {
    /// From `json.dumps`' keyword arguments: `indent` an int (spaces) or a
    /// string, `separators` a pair of strings.
    pub(super) fn from_python_args(
        ensure_ascii: bool,
        indent: Option<Value>,
        separators: Option<Value>,
        sort_keys: bool,
    ) -> Result<DumpOptions, Error> {
        let indent = match indent {
            None => None,
            Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_owned()),
            Some(v) => {
                let n = i64::try_from(v.clone())
                    .map_err(|_| Error::new(ErrorKind::InvalidOperation, format!("tojson indent {v} is not an int")))?;
                Some(" ".repeat(n.max(0) as usize))
            }
        };
        let (item_separator, key_separator) = match separators {
            None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
            None => (", ".to_owned(), ": ".to_owned()),
            Some(pair) => {
                let items: Vec<Value> = pair.try_iter()?.collect();
                match items.as_slice() {
                    [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                        (item.to_string(), key.to_string())
                    }
                    _ => {
                        return Err(Error::new(
                            ErrorKind::InvalidOperation,
                            "tojson separators must be a pair of strings",
                        ));
                    }
                }
            }
        };
        Ok(DumpOptions { ensure_ascii, indent, item_separator, key_separator, sort_keys })
    }
}

pub(super) fn dumps(value: &Value, options: &DumpOptions) -> Result<String, Error> {
    let mut out = String::new();
    write_value(&mut out, value, options, 0)?;
    Ok(out)
}

fn not_serializable(value: &Value) -> Error {
    Error::new(ErrorKind::InvalidOperation, format!("Object of type {} is not JSON serializable", value.kind()))
}

fn write_value(out: &mut String, value: &Value, options: &DumpOptions, depth: usize) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, value),
        ValueKind::String => write_string(out, value.as_str().unwrap_or_default(), options.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, options, depth, ('[', ']'), &items, |out, item, depth| {
                write_value(out, item, options, depth)
            })?;
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((key_text(&key)?, item));
            }
            if options.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(out, options, depth, ('{', '}'), &entries, |out, (key, item), depth| {
                write_string(out, key, options.ensure_ascii);
                out.push_str(&options.key_separator);
                write_value(out, item, options, depth)
            })?;
        }
        _ => return Err(not_serializable(value)),
    }
    Ok(())
}

fn write_container<T>(
    out: &mut String,
    options: &DumpOptions,
    depth: usize,
    (open, close): (char, char),
    items: &[T],
    mut write_item: impl FnMut(&mut String, &T, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(indent) = &options.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    };
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&options.item_separator);
        }
        newline(out, depth + 1);
        write_item(out, item, depth + 1)?;
    }
    newline(out, depth);
    out.push(close);
    Ok(())
}

/// A dict key as `json.dumps` writes it: strings as they are, numbers,
/// booleans and None in their JSON spelling.
fn key_text(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_owned(),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_owned(),
        ValueKind::None => "null".to_owned(),
        ValueKind::Number => {
            let mut text = String::new();
            write_number(&mut text, key);
            text
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("keys must be str, int, float, bool or None, not {}", key.kind()),
            ));
        }
    })
}

fn write_number(out: &mut String, value: &Value) {
    if value.is_integer() {
        out.push_str(&value.to_string());
        return;
    }
    let x = f64::try_from(value.clone()).unwrap_or(f64::NAN);
    out.push_str(&match x {
        x if x.is_nan() => "NaN".into(),
        f64::INFINITY => "Infinity".into(),
        f64::NEG_INFINITY => "-Infinity".into(),
        x => python_float_repr(x),
    });
}

/// Python's `repr(float)`, which `json` also writes for finite floats: the
/// shortest digits that read back the same, positional when the decimal
/// exponent is in `-4..16`, else `d.ddde±XX`; `nan`, `inf`, `-inf`.
pub(super) fn python_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf".into() } else { "-inf".into() };
    }
    // Rust's `{:e}` gives the same shortest round-trip digits: "1.5e-5".
    let scientific = format!("{x:e}");
    let (mantissa, exponent) = scientific.split_once('e').expect("`{:e}` has an exponent");
    let exponent: i32 = exponent.parse().expect("`{:e}` exponent is an integer");
    let (sign, mantissa) = mantissa.strip_prefix('-').map_or(("", mantissa), |m| ("-", m));
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exponent) {
        let point = exponent + 1;
        let body = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if point as usize >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
        };
        format!("{sign}{body}")
    } else {
        let sign_e = if exponent < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{sign_e}{:02}", exponent.abs())
    }
}

fn write_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            // ensure_ascii escapes everything outside the printable ASCII range, DEL included.
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{:04x}", unit);
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dumps_with(value: Value, indent: Option<Value>, ensure_ascii: bool) -> String {
        dumps(&value, &DumpOptions::from_python_args(ensure_ascii, indent, None, false).unwrap()).unwrap()
    }

    #[test]
    fn float_repr_matches_python() {
        // Expected strings are Python 3's repr() of the same floats.
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1.5e-7, "1.5e-07"),
            (123456789.125, "123456789.125"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (0.0, "0.0"),
        ];
        for (x, expected) in cases {
            assert_eq!(python_float_repr(x), expected, "{x}");
        }
    }

    #[test]
    fn strings_escape_like_python() {
        let s = Value::from("a\"b\\c\n\u{1}é😀\u{7f}");
        assert_eq!(dumps_with(s.clone(), None, false), "\"a\\\"b\\\\c\\n\\u0001é😀\u{7f}\"");
        assert_eq!(dumps_with(s, None, true), "\"a\\\"b\\\\c\\n\\u0001\\u00e9\\ud83d\\ude00\\u007f\"");
    }

    #[test]
    fn containers_use_python_separators() {
        let value = Value::from(minijinja::value::Serde(serde_json::json!({"a": [1, 2.5, null, true], "b": {}})));
        assert_eq!(dumps_with(value.clone(), None, false), r#"{"a": [1, 2.5, null, true], "b": {}}"#);
        assert_eq!(
            dumps_with(value, Some(Value::from(2)), false),
            "{\n  \"a\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"b\": {}\n}"
        );
    }
}

//! Tool calls written in a model's own syntax, read back from its reply as it
//! streams. Which syntax a model writes is read off its chat template (the
//! template prints earlier calls the way the model was trained to write them):
//!
//! - Hermes (Qwen2.5, Qwen3): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`;
//!   Qwen3-Coder and Qwen3.5 put `<function=NAME>` with `<parameter=KEY>\nVALUE\n</parameter>`
//!   elements between the same tags, GLM-4.5 to 4.7 `NAME` and `<arg_key>KEY</arg_key>`
//!   `<arg_value>VALUE</arg_value>` pairs;
//! - Gemma 4: `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>`.
//!
//! gpt-oss's harmony calls (`to=functions.NAME`) are messages of the harmony
//! format, read by [`super::reply`]. Text anywhere in the reply is searched
//! (before a call, between calls, inside `<think>`); a call that does not parse
//! stays text. Small Hermes models (Qwen2.5-Coder 0.5B) often leave the tags
//! out: a reply that opens with a bare `{"name": ..., "arguments": ...}` object
//! naming a declared tool is a call too (llama.cpp's Hermes parser takes these).

use serde_json::{Map, Value};

use super::FunctionCall;
pub use super::forced_calls::forced_calls_grammar;

/// A tool-call syntax with start and end markers around each call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolSyntax {
    /// `<tool_call>` ... `</tool_call>` around JSON or `<function=NAME>` XML.
    Hermes,
    /// `<|tool_call>call:NAME{...}<tool_call|>`.
    Gemma4,
}

impl ToolSyntax {
    /// The syntax a chat template prints tool calls in, if it is one we read.
    /// MiniMax's `<invoke name=...>` and Apriel's `<tool_calls>[...]` share the
    /// `<tool_call>` word but not the syntax: none.
    pub fn of_template(source: &str) -> Option<ToolSyntax> {
        if source.contains("<|tool_call>") {
            Some(ToolSyntax::Gemma4)
        } else if source.contains("<tool_call>") && !source.contains("<invoke") && !source.contains("<tool_calls>") {
            Some(ToolSyntax::Hermes)
        } else {
            None
        }
    }

    fn markers(self) -> (&'static str, &'static str) {
        match self {
            ToolSyntax::Hermes => ("<tool_call>", "</tool_call>"),
            ToolSyntax::Gemma4 => ("<|tool_call>", "<tool_call|>"),
        }
    }

    /// Whether the markers are control tokens, which decode to text only when
    /// special tokens are shown.
    pub fn needs_special_tokens(self) -> bool {
        self == ToolSyntax::Gemma4
    }

    /// The call between the markers, or `None` when it does not parse.
    fn parse_call(self, body: &str, tools: &[Value]) -> Option<FunctionCall> {
        match self {
            ToolSyntax::Hermes => {
                let body = body.trim();
                if body.starts_with("<function=") {
                    parse_xml_function(body, tools)
                } else if body.starts_with('{') {
                    parse_json_call(body)
                } else {
                    parse_glm_call(body, tools)
                }
            }
            ToolSyntax::Gemma4 => parse_gemma4_call(body.trim()),
        }
    }

    /// Whether a call's body may go on past an end marker found in it: JSON
    /// with an open string or bracket (arguments that contain the marker).
    fn body_incomplete(self, body: &str) -> bool {
        match self {
            ToolSyntax::Hermes if body.trim_start().starts_with('{') => json_open(body),
            _ => false,
        }
    }
}

/// What a stretch of reply text turned out to be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolCallPiece {
    Text(String),
    Call(FunctionCall),
}

/// Splits a streamed reply into text and tool calls. Text that could be the
/// start of a call marker is held back until it is known not to be; a call's
/// text is held until its end marker.
#[derive(Clone, Debug)]
pub struct ToolCallParser {
    syntax: ToolSyntax,
    /// The request's tool declarations (for parameter types).
    tools: Vec<Value>,
    /// Text not yet given out: a possible marker start, or a call being read
    /// (starting with its start marker).
    pending: String,
    in_call: bool,
    /// Nothing but whitespace and bare calls so far: a bare call may come.
    at_start: bool,
}

impl ToolCallParser {
    pub fn new(syntax: ToolSyntax, tools: &[Value]) -> ToolCallParser {
        ToolCallParser { syntax, tools: tools.to_vec(), pending: String::new(), in_call: false, at_start: true }
    }

    /// Consumes a piece of the reply; returns what it completes.
    pub fn feed(&mut self, piece: &str) -> Vec<ToolCallPiece> {
        let (start, end) = self.syntax.markers();
        let mut out = Vec::new();
        self.pending.push_str(piece);
        loop {
            if self.in_call {
                let mut from = start.len();
                let found = loop {
                    let Some(at) = self.pending[from..].find(end) else { break None };
                    let body_end = from + at;
                    if !self.syntax.body_incomplete(&self.pending[start.len()..body_end]) {
                        break Some(body_end);
                    }
                    from = body_end + end.len();
                };
                let Some(body_end) = found else { break };
                let whole: String = self.pending.drain(..body_end + end.len()).collect();
                self.in_call = false;
                match self.syntax.parse_call(&whole[start.len()..body_end], &self.tools) {
                    Some(call) => out.push(ToolCallPiece::Call(call)),
                    None => push_text(&mut out, &whole),
                }
            } else if self.at_start && self.syntax == ToolSyntax::Hermes {
                let body = self.pending.trim_start();
                if body.is_empty() || (body.starts_with('{') && json_open(body)) {
                    break;
                }
                let call = json_object_len(body).and_then(|n| {
                    let call = parse_json_call(&body[..n]).filter(|c| declares(&self.tools, &c.name))?;
                    Some((self.pending.len() - body.len() + n, call))
                });
                match call {
                    Some((end, call)) => {
                        self.pending.drain(..end);
                        out.push(ToolCallPiece::Call(call));
                    }
                    None => self.at_start = false,
                }
            } else if let Some(at) = self.pending.find(start) {
                let text: String = self.pending.drain(..at).collect();
                push_text(&mut out, &text);
                self.in_call = true;
                self.at_start = false;
            } else {
                let keep = longest_marker_prefix(&self.pending, start);
                let text: String = self.pending.drain(..self.pending.len() - keep).collect();
                push_text(&mut out, &text);
                break;
            }
        }
        out
    }

    /// Ends the reply: a call left open (no end marker: the reply was cut, or
    /// the model ended its turn right after the arguments) counts when it
    /// parses; everything else held back is text.
    pub fn finish(&mut self) -> Vec<ToolCallPiece> {
        let (start, _) = self.syntax.markers();
        let rest = std::mem::take(&mut self.pending);
        self.at_start = false;
        let mut out = Vec::new();
        if std::mem::take(&mut self.in_call)
            && let Some(call) = self.syntax.parse_call(&rest[start.len()..], &self.tools)
        {
            out.push(ToolCallPiece::Call(call));
        } else {
            push_text(&mut out, &rest);
        }
        out
    }

    /// A whole reply: its text outside calls, and the calls in order.
    pub fn parse(syntax: ToolSyntax, tools: &[Value], text: &str) -> (String, Vec<FunctionCall>) {
        let mut parser = ToolCallParser::new(syntax, tools);
        let mut pieces = parser.feed(text);
        pieces.extend(parser.finish());
        let (mut content, mut calls) = (String::new(), Vec::new());
        for piece in pieces {
            match piece {
                ToolCallPiece::Text(t) => content.push_str(&t),
                ToolCallPiece::Call(c) => calls.push(c),
            }
        }
        (content, calls)
    }
}

fn push_text(out: &mut Vec<ToolCallPiece>, text: &str) {
    if text.is_empty() {
        return;
    }
    match out.last_mut() {
        Some(ToolCallPiece::Text(last)) => last.push_str(text),
        _ => out.push(ToolCallPiece::Text(text.to_owned())),
    }
}

/// The length of the longest end of `text` that is a proper start of `marker`.
fn longest_marker_prefix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

/// Whether `tools` declares a function `name`.
fn declares(tools: &[Value], name: &str) -> bool {
    tools.iter().any(|t| t.pointer("/function/name").and_then(Value::as_str) == Some(name))
}

/// The length of the JSON object `text` opens with, through its closing brace.
fn json_object_len(text: &str) -> Option<usize> {
    text.starts_with('{').then(|| json_scan(text).first_close).flatten()
}

/// Whether JSON text ends inside a string or an open bracket.
fn json_open(text: &str) -> bool {
    json_scan(text).open_at_end
}

/// JSON text read by its strings and brackets alone.
struct JsonScan {
    /// Just past the bracket that first brings the depth back to zero.
    first_close: Option<usize>,
    /// Whether the text ends inside a string or an open bracket.
    open_at_end: bool,
}

fn json_scan(text: &str) -> JsonScan {
    let (mut depth, mut in_string, mut escaped) = (0i64, false, false);
    let mut first_close = None;
    for (i, c) in text.char_indices() {
        if in_string {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '{' | '[' => depth += 1,
            '}' | ']' => {
                depth -= 1;
                if depth == 0 {
                    first_close.get_or_insert(i + 1);
                }
            }
            _ => {}
        }
    }
    JsonScan { first_close, open_at_end: in_string || depth > 0 }
}

/// `{"name": NAME, "arguments": {...}}`; `parameters` is taken for
/// `arguments` (Llama 3's word), and arguments given as a JSON string are
/// read as the object the string holds.
fn parse_json_call(body: &str) -> Option<FunctionCall> {
    let Value::Object(mut call) = serde_json::from_str::<Value>(body).ok()? else { return None };
    let name = match call.remove("name")? {
        Value::String(name) if !name.is_empty() => name,
        _ => return None,
    };
    let arguments = match call.remove("arguments").or_else(|| call.remove("parameters")) {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(Value::String(s)) => serde_json::from_str::<Value>(&s).ok().filter(Value::is_object)?,
        Some(v @ Value::Object(_)) => v,
        Some(_) => return None,
    };
    Some(FunctionCall { name, arguments })
}

/// Qwen3-Coder's `<function=NAME>` followed by `<parameter=KEY>\nVALUE\n</parameter>`
/// elements and `</function>`. A value is JSON where the tool declares the
/// parameter other than a string and the text parses as JSON, else the text
/// (as Qwen3-Coder's own parser reads them).
fn parse_xml_function(body: &str, tools: &[Value]) -> Option<FunctionCall> {
    let rest = body.strip_prefix("<function=")?;
    let (name, mut rest) = rest.split_once('>')?;
    let name = name.trim();
    if !valid_name(name) {
        return None;
    }
    let mut arguments = Map::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix("</function>") {
            return after
                .trim()
                .is_empty()
                .then(|| FunctionCall { name: name.to_owned(), arguments: arguments.into() });
        }
        let after = rest.strip_prefix("<parameter=")?;
        let (key, after) = after.split_once('>')?;
        let (value, after) = after.split_once("</parameter>")?;
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        arguments.insert(key.trim().to_owned(), xml_value(value, declared_type(tools, name, key.trim())));
        rest = after;
    }
}

/// GLM's `NAME` then `<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>` pairs; values
/// typed as in [`parse_xml_function`].
fn parse_glm_call(body: &str, tools: &[Value]) -> Option<FunctionCall> {
    let end = body.find('<').unwrap_or(body.len());
    let name = body[..end].trim();
    if !valid_name(name) {
        return None;
    }
    let mut arguments = Map::new();
    let mut rest = &body[end..];
    while !rest.trim().is_empty() {
        let after = rest.trim_start().strip_prefix("<arg_key>")?;
        let (key, after) = after.split_once("</arg_key>")?;
        let after = after.trim_start().strip_prefix("<arg_value>")?;
        let (value, after) = after.split_once("</arg_value>")?;
        arguments.insert(key.trim().to_owned(), xml_value(value, declared_type(tools, name, key.trim())));
        rest = after;
    }
    Some(FunctionCall { name: name.to_owned(), arguments: arguments.into() })
}

/// A function name as models write them: letters, digits, `_`, `-`, `.`.
fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.chars().all(|c| c.is_alphanumeric() || "_-.".contains(c))
}

/// The JSON-schema `type` a tool declares for one parameter.
fn declared_type<'a>(tools: &'a [Value], function: &str, parameter: &str) -> Option<&'a str> {
    tools
        .iter()
        .filter_map(|t| t.get("function"))
        .find(|f| f.get("name").and_then(Value::as_str) == Some(function))?
        .pointer(&format!("/parameters/properties/{}/type", parameter.replace('~', "~0").replace('/', "~1")))?
        .as_str()
}

fn xml_value(text: &str, declared: Option<&str>) -> Value {
    if declared == Some("string") {
        return Value::String(text.to_owned());
    }
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_owned()))
}

/// Gemma 4's `call:NAME{...}`: an object whose keys are bare words and whose
/// strings are quoted with `<|"|>`.
fn parse_gemma4_call(body: &str) -> Option<FunctionCall> {
    let rest = body.strip_prefix("call:")?;
    let brace = rest.find('{')?;
    let name = rest[..brace].trim();
    if !valid_name(name) {
        return None;
    }
    let arguments = gemma4_to_json(&rest[brace..])?;
    let arguments: Value = serde_json::from_str(&arguments).ok().filter(Value::is_object)?;
    Some(FunctionCall { name: name.to_owned(), arguments })
}

/// Gemma 4's argument notation as JSON text: `<|"|>`-quoted strings become
/// JSON strings, bare words before `:` become keys, other bare words stay
/// (numbers, `true`, `false`, `null`) or, when not JSON, become strings.
fn gemma4_to_json(text: &str) -> Option<String> {
    const QUOTE: &str = "<|\"|>";
    let mut out = String::with_capacity(text.len() + 16);
    let mut rest = text;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix(QUOTE) {
            let end = after.find(QUOTE)?;
            out.push_str(&Value::String(after[..end].to_owned()).to_string());
            rest = &after[end + QUOTE.len()..];
        } else if let Some(c) = rest.chars().next().filter(|c| "{}[]:,".contains(*c) || c.is_whitespace()) {
            out.push(c);
            rest = &rest[c.len_utf8()..];
        } else {
            let end = rest.find(|c: char| "{}[]:,".contains(c)).unwrap_or(rest.len());
            let end = rest.find(QUOTE).map_or(end, |q| q.min(end));
            let word = rest[..end].trim();
            let is_key = rest[end..].starts_with(':');
            if is_key || serde_json::from_str::<Value>(word).is_err() {
                out.push_str(&Value::String(word.to_owned()).to_string());
            } else {
                out.push_str(word);
            }
            rest = &rest[end..];
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marker_prefixes() {
        assert_eq!(longest_marker_prefix("abc <tool", "<tool_call>"), 5);
        assert_eq!(longest_marker_prefix("abc <", "<tool_call>"), 1);
        assert_eq!(longest_marker_prefix("abc", "<tool_call>"), 0);
        assert_eq!(longest_marker_prefix("é<", "<tool_call>"), 1);
    }

    #[test]
    fn open_json() {
        assert!(json_open(r#"{"a": "x"#));
        assert!(json_open(r#"{"a": {"b": 1}"#));
        assert!(!json_open(r#"{"a": "\"}"}"#));
        assert!(!json_open("not json"));
    }

    #[test]
    fn gemma4_notation() {
        assert_eq!(
            gemma4_to_json(r#"{city:<|"|>Paris, "FR"<|"|>,n:3,ok:true,tags:[<|"|>a<|"|>,b]}"#).unwrap(),
            r#"{"city":"Paris, \"FR\"","n":3,"ok":true,"tags":["a","b"]}"#
        );
    }
}

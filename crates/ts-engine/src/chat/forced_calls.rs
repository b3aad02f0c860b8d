//! The grammar (llguidance's Lark) of a reply made only of calls to the
//! request's tools, for `tool_choice` required or a named function, written in
//! the syntax the model's chat template prints calls in, so that
//! [`super::tool_calls`] and [`super::reply`] read the reply back as calls:
//!
//! - Hermes JSON: the call object under a JSON schema;
//! - Qwen3-Coder / Qwen3.5 `<function=NAME>` with `<parameter=KEY>` elements,
//!   GLM's `<arg_key>`/`<arg_value>` pairs, Gemma 4's `call:NAME{key:value}`:
//!   declared names and keys only, each key at most once (a 64-bit set per
//!   object: keys past the 64th may repeat), every required key, and each
//!   value by its declared type (free text for strings, JSON for the rest;
//!   Gemma 4's own notation all the way down);
//! - gpt-oss harmony: an optional analysis message, then one
//!   `commentary to=functions.NAME` message with JSON arguments.
//!
//! Properties a schema does not declare are never written, whatever its
//! `additionalProperties`.

use serde_json::{Value, json};

use super::tool_calls::ToolSyntax;
use crate::constraint::with_json_options;

/// How a template writes one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CallForm {
    HermesJson,
    /// Qwen3-Coder and Qwen3.5: `<function=NAME>` in `<tool_call>` tags.
    QwenXml,
    /// GLM-4.5 to 4.7: `NAME` and `<arg_key>`/`<arg_value>` pairs in `<tool_call>` tags;
    /// 4.5 and 4.6 put each pair and the end tag on a line of its own, 4.7 nothing between.
    Glm {
        lines: bool,
    },
    Gemma4,
    Harmony,
}

impl CallForm {
    fn of_template(template: &str) -> Option<CallForm> {
        if template.contains("<|channel|>") && template.contains("functions.") {
            return Some(CallForm::Harmony);
        }
        Some(match ToolSyntax::of_template(template)? {
            ToolSyntax::Gemma4 => CallForm::Gemma4,
            ToolSyntax::Hermes if template.contains("<function=") => CallForm::QwenXml,
            ToolSyntax::Hermes if template.contains("<arg_key>") => {
                CallForm::Glm { lines: template.contains("</arg_key>\n") }
            }
            ToolSyntax::Hermes => CallForm::HermesJson,
        })
    }
}

/// The grammar of a reply made only of calls to `tools` (declarations as sent),
/// each in the template's syntax with arguments held to its function's
/// `parameters`: `tool_choice` required or named. With `parallel`, one call or
/// more (harmony ends its turn at a call: always one). `None` where the
/// template prints calls in no syntax we read, or a schema has more than 64
/// required properties.
pub fn forced_calls_grammar(template: &str, tools: &[Value], parallel: bool) -> Option<String> {
    let form = CallForm::of_template(template)?;
    if tools.is_empty() {
        return None;
    }
    let functions: Vec<(&str, Value)> = tools
        .iter()
        .filter_map(|t| {
            let f = &t["function"];
            let parameters =
                f.get("parameters").filter(|p| p.is_object()).cloned().unwrap_or(json!({"type": "object"}));
            Some((f["name"].as_str()?, parameters))
        })
        .collect();
    let mut g = Lark::default();
    let call = match form {
        CallForm::HermesJson => hermes_json_call(&functions),
        CallForm::Harmony => return Some(g.harmony(&functions)),
        _ => {
            let mut calls = Vec::with_capacity(functions.len());
            for (name, parameters) in &functions {
                calls.push(g.call(form, name, parameters)?);
            }
            g.rule("call", calls.join(" | "))
        }
    };
    let sep = if form == CallForm::Gemma4 { "" } else { "\"\\n\" " };
    let start = if parallel { format!("{call} ({sep}{call})*") } else { call };
    Some(g.finish(start))
}

/// Hermes' `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`: one
/// JSON schema over the call object.
fn hermes_json_call(functions: &[(&str, Value)]) -> String {
    let calls: Vec<Value> = functions
        .iter()
        .map(|(name, parameters)| {
            json!({"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
                   "required": ["name", "arguments"], "additionalProperties": false})
        })
        .collect();
    let call = match <[Value; 1]>::try_from(calls) {
        Ok([one]) => one,
        Err(many) => json!({"anyOf": many}),
    };
    format!("(\"<tool_call>\\n\" %json{} \"\\n</tool_call>\")", with_json_options(&call))
}

/// A grammar being written: its rules, named by a counter.
#[derive(Default)]
struct Lark {
    rules: Vec<String>,
    next: usize,
}

/// Gemma 4's string quote (a token of its own).
const GEMMA_QUOTE: &str = "<|\"|>";

impl Lark {
    /// A new rule `prefix<n>` (or `prefix<n>[attrs]` / `prefix<n>::_` where the
    /// prefix carries them) with `body`; its name.
    fn rule(&mut self, prefix: &str, body: String) -> String {
        self.next += 1;
        let name = format!("{prefix}{}", self.next);
        self.rules.push(format!("{name}: {body}"));
        name
    }

    fn finish(self, start: String) -> String {
        let mut out = format!("start: {start}\n");
        for r in self.rules {
            out.push_str(&r);
            out.push('\n');
        }
        out
    }

    /// One call of `name` in an XML, GLM or Gemma 4 form.
    fn call(&mut self, form: CallForm, name: &str, parameters: &Value) -> Option<String> {
        let body = match form {
            CallForm::QwenXml => {
                let members = self.members(parameters, None, |g, key, schema| {
                    let value = g.text_value(schema, "\n</parameter>", true);
                    format!("{} {value} \"\\n\"", lit(&format!("<parameter={key}>\n")))
                })?;
                format!(
                    "{} {members} \"</function>\\n</tool_call>\"",
                    lit(&format!("<tool_call>\n<function={name}>\n"))
                )
            }
            CallForm::Glm { lines } => {
                let nl = if lines { "\n" } else { "" };
                let members = self.members(parameters, None, |g, key, schema| {
                    let value = g.text_value(schema, "</arg_value>", false);
                    format!("{} {value}", lit(&format!("{nl}<arg_key>{key}</arg_key>{nl}<arg_value>")))
                })?;
                format!("{} {members} {}", lit(&format!("<tool_call>{name}")), lit(&format!("{nl}</tool_call>")))
            }
            CallForm::Gemma4 => {
                let object = self.gemma_object(parameters)?;
                format!("{} {object} \"<tool_call|>\"", lit(&format!("<|tool_call>call:{name}")))
            }
            CallForm::HermesJson | CallForm::Harmony => unreachable!("not a form of keyed values"),
        };
        Some(self.rule("fn", body))
    }

    /// The declared properties of an object schema, each written once at most by
    /// `member` (in any order), every required one present; `sep` between members.
    /// A rule over a 64-bit set of the properties written so far, required ones
    /// first; `None` past 64 required.
    fn members(
        &mut self,
        schema: &Value,
        sep: Option<&str>,
        mut member: impl FnMut(&mut Lark, &str, &Value) -> String,
    ) -> Option<String> {
        let props = schema.get("properties").and_then(Value::as_object);
        let required: Vec<&str> =
            schema.get("required").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str).collect();
        let mut keys: Vec<(&String, &Value)> = props.into_iter().flatten().collect();
        keys.sort_by_key(|(k, _)| !required.contains(&k.as_str()));
        let n_required = keys.iter().filter(|(k, _)| required.contains(&k.as_str())).count();
        if n_required > 64 {
            return None;
        }
        if keys.is_empty() {
            return Some("\"\"".into());
        }
        let elements: Vec<String> = keys.iter().map(|(k, s)| member(self, k, s)).collect();
        self.next += 1;
        let (first, rest) = (format!("mf{}", self.next), format!("mr{}", self.next));
        let done = match n_required {
            0 => "\"\"".to_owned(),
            n => format!("\"\" %if is_ones([0:{n}])"),
        };
        let alternatives = |after: &str, lead: &str| {
            let mut alts = vec![done.clone()];
            for (i, e) in elements.iter().enumerate() {
                alts.push(if i < 64 {
                    format!("{lead}{e} {after}::set_bit({i}) %if bit_clear({i})")
                } else {
                    format!("{lead}{e} {after}::_")
                });
            }
            alts.join("\n    | ")
        };
        match sep {
            None => self.rules.push(format!("{first}::_ : {}", alternatives(&first, ""))),
            Some(sep) => {
                self.rules.push(format!("{first}::_ : {}", alternatives(&rest, "")));
                self.rules.push(format!("{rest}::_ : {}", alternatives(&rest, &format!("{} ", lit(sep)))));
            }
        }
        Some(format!("{first}::0x0"))
    }

    /// A value as text closed by `close` (XML's `\n</parameter>`, GLM's
    /// `</arg_value>`), the close included: a declared string as its text (an
    /// enum's alternatives, else free text that cannot hold the close tag, within
    /// `minLength`/`maxLength`), anything else as JSON under its schema, which the
    /// parsers read back as JSON where the declared type is not `string`. With
    /// `lead_newline`, the text's own newline before the close tag may be left out.
    fn text_value(&mut self, schema: &Value, close: &str, lead_newline: bool) -> String {
        let tag = close.trim_start_matches('\n');
        let declared_string = schema.get("type").and_then(Value::as_str) == Some("string");
        if let Some(options) = string_options(schema) {
            // Undeclared strings that read as JSON ("1", "true") would come back as JSON.
            let as_text = declared_string || options.iter().all(|o| serde_json::from_str::<Value>(o).is_err());
            let options: Vec<String> = options.iter().filter(|o| !o.contains(tag)).map(|o| lit(o)).collect();
            if as_text && !options.is_empty() {
                return format!("({}) {}", options.join(" | "), lit(close));
            }
        }
        if !declared_string {
            return format!("%json{} {}", with_json_options(schema), lit(close));
        }
        let newline = if lead_newline { "\\n?" } else { "" };
        let text = format!("(?s:{}{newline}){}", length_regex(schema), regex_escape(tag));
        self.lazy_text(text)
    }

    /// A rule of free text up to and through its closing delimiter: `regex` matched lazily,
    /// so the text ends at the delimiter's first occurrence.
    fn lazy_text(&mut self, regex: String) -> String {
        self.next += 1;
        let name = format!("text{}", self.next);
        self.rules.push(format!("{name}[lazy]: /{regex}/"));
        name
    }

    /// An object in Gemma 4's notation: `{key:value,...}` with bare keys.
    fn gemma_object(&mut self, schema: &Value) -> Option<String> {
        let members =
            self.members(schema, Some(","), |g, key, s| format!("{} {}", lit(&format!("{key}:")), g.gemma_value(s)))?;
        Some(format!("\"{{\" {members} \"}}\""))
    }

    /// A value in Gemma 4's notation under `schema`: strings in `<|"|>` quotes,
    /// numbers, booleans and null as JSON, objects and arrays by their declared
    /// members; what a schema does not pin down, any value.
    fn gemma_value(&mut self, schema: &Value) -> String {
        if let Some(options) = schema.get("enum").and_then(Value::as_array).map(Vec::as_slice) {
            return alternatives(options.iter().map(gemma_literal));
        }
        if let Some(c) = schema.get("const") {
            return gemma_literal(c);
        }
        if let Some(any) = schema.get("anyOf").or_else(|| schema.get("oneOf")).and_then(Value::as_array) {
            let alts: Vec<String> = any.iter().map(|s| self.gemma_value(s)).collect();
            return format!("({})", alts.join(" | "));
        }
        match schema.get("type").and_then(Value::as_str) {
            Some("string") => {
                let text = self.lazy_text(format!("(?s:{}){}", length_regex(schema), regex_escape(GEMMA_QUOTE)));
                format!("{} {text}", lit(GEMMA_QUOTE))
            }
            Some("integer" | "number" | "boolean" | "null") => format!("%json{}", with_json_options(schema)),
            Some("object") if schema.get("properties").is_some() => {
                self.gemma_object(schema).unwrap_or_else(|| self.gemma_any())
            }
            Some("array") => {
                let item = match schema.get("items") {
                    Some(items) => self.gemma_value(items),
                    None => self.gemma_any(),
                };
                let item = self.rule("item", item);
                format!("\"[\" ({item} (\",\" {item})*)? \"]\"")
            }
            _ => self.gemma_any(),
        }
    }

    /// Any value in Gemma 4's notation (one set of rules per grammar).
    fn gemma_any(&mut self) -> String {
        if !self.rules.iter().any(|r| r.starts_with("gany:")) {
            let q = lit(GEMMA_QUOTE);
            let quote = regex_escape(GEMMA_QUOTE);
            self.rules.push(format!(
                "gany: {q} gtext | GNUM | \"true\" | \"false\" | \"null\" \
                 | \"{{\" (GKEY \":\" gany (\",\" GKEY \":\" gany)*)? \"}}\" | \"[\" (gany (\",\" gany)*)? \"]\""
            ));
            self.rules.push(format!("gtext[lazy]: /(?s:.*){quote}/"));
            self.rules.push(r"GNUM: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/".into());
            self.rules.push(r"GKEY: /[A-Za-z_][A-Za-z0-9_\-]*/".into());
        }
        "gany".into()
    }

    /// gpt-oss: an optional analysis message, then a call of one of `functions`
    /// whose content is its JSON arguments; the turn's `<|call|>` is the
    /// end-of-generation token the grammar allows once complete.
    fn harmony(mut self, functions: &[(&str, Value)]) -> String {
        let calls: Vec<String> = functions
            .iter()
            .map(|(name, parameters)| {
                let header = format!("<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>");
                format!("{} %json{}", lit(&header), with_json_options(parameters))
            })
            .collect();
        let call = self.rule("call", calls.join(" | "));
        self.rules.push(r"analysis[lazy]: /(?s:.*)<\|end\|>/".into());
        self.finish(format!("(\"<|channel|>analysis<|message|>\" analysis \"<|start|>assistant\")? {call}"))
    }
}

/// The strings a string schema allows, when it lists them (`enum` or `const`).
fn string_options(schema: &Value) -> Option<Vec<&str>> {
    if let Some(c) = schema.get("const") {
        return c.as_str().map(|s| vec![s]);
    }
    schema.get("enum")?.as_array()?.iter().map(Value::as_str).collect()
}

/// `.{min,max}` for a string schema's length bounds (characters).
fn length_regex(schema: &Value) -> String {
    let bound = |k: &str| schema.get(k).and_then(Value::as_u64);
    match (bound("minLength").unwrap_or(0), bound("maxLength")) {
        (0, None) => ".*".into(),
        (min, None) => format!(".{{{min},}}"),
        (min, Some(max)) => format!(".{{{min},{max}}}"),
    }
}

/// A Lark string literal (JSON's string syntax).
fn lit(s: &str) -> String {
    Value::String(s.to_owned()).to_string()
}

fn alternatives(options: impl Iterator<Item = String>) -> String {
    format!("({})", options.collect::<Vec<_>>().join(" | "))
}

/// A value written in Gemma 4's notation, as a literal.
fn gemma_literal(v: &Value) -> String {
    lit(&gemma_text(v))
}

fn gemma_text(v: &Value) -> String {
    match v {
        Value::String(s) => format!("{GEMMA_QUOTE}{s}{GEMMA_QUOTE}"),
        Value::Array(a) => format!("[{}]", a.iter().map(gemma_text).collect::<Vec<_>>().join(",")),
        Value::Object(o) => {
            format!("{{{}}}", o.iter().map(|(k, v)| format!("{k}:{}", gemma_text(v))).collect::<Vec<_>>().join(","))
        }
        other => other.to_string(),
    }
}

/// `s` as a regex matching itself, inside Lark's `/.../`.
fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 2);
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~/".contains(c) {
            out.push('\\');
        }
        if c == '\n' {
            out.push_str("\\n");
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::FunctionCall;
    use crate::chat::reply::ReplyParser;
    use crate::constraint::{Grammar, Grammars};
    use ts_tokenizer::Tokenizer;

    const QWEN35: &str = include_str!("../../tests/data/chat/templates/Qwen3.5-4B.jinja");
    const QWEN3_CODER: &str = include_str!("../../tests/data/chat/templates/Qwen3-Coder.jinja");
    const GLM46: &str = include_str!("../../tests/data/chat/templates/GLM-4.6.jinja");
    const GLM47: &str = include_str!("../../tests/data/chat/templates/GLM-4.7-Flash.jinja");
    const GEMMA4: &str = include_str!("../../tests/data/chat/templates/google-gemma-4-31B-it.jinja");
    const GPT_OSS: &str = include_str!("../../tests/data/chat/templates/openai-gpt-oss-120b.jinja");

    /// A committed fixture's tokenizer (real tokenizer shapes, 512 tokens).
    fn tokenizer(family: &str) -> Tokenizer {
        Tokenizer::from_gguf(ts_testkit::fixtures_dir().join(family).join("model-q8_0.gguf")).unwrap()
    }

    fn tools() -> Vec<Value> {
        vec![
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]},
                               "days": {"type": "integer", "minimum": 1, "maximum": 7}, "detailed": {"type": "boolean"}},
                "required": ["city", "unit"], "additionalProperties": false}}}),
            json!({"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"], "additionalProperties": false}}}),
        ]
    }

    /// `value` checked against the schemas of [`tools`]: keys declared, required present, types.
    fn valid(schema: &Value, value: &Value) -> bool {
        let ok = match schema.get("type").and_then(Value::as_str) {
            Some("object") => value.as_object().is_some_and(|o| {
                let props = schema["properties"].as_object().unwrap();
                let required = schema["required"].as_array().unwrap();
                required.iter().all(|k| o.contains_key(k.as_str().unwrap()))
                    && o.iter().all(|(k, v)| props.get(k).is_some_and(|s| valid(s, v)))
            }),
            Some("string") => value.as_str().is_some_and(|s| {
                schema.get("maxLength").and_then(Value::as_u64).is_none_or(|m| s.chars().count() as u64 <= m)
            }),
            Some("integer") => value.as_i64().is_some_and(|n| {
                schema.get("minimum").and_then(Value::as_i64).is_none_or(|m| n >= m)
                    && schema.get("maximum").and_then(Value::as_i64).is_none_or(|m| n <= m)
            }),
            Some("boolean") => value.is_boolean(),
            _ => true,
        };
        ok && schema.get("enum").and_then(Value::as_array).is_none_or(|e| e.contains(value))
    }

    fn check_call(call: &FunctionCall) {
        let tools = tools();
        let tool = tools.iter().find(|t| t["function"]["name"] == call.name.as_str()).expect("a declared function");
        assert!(valid(&tool["function"]["parameters"], &call.arguments), "{call:?}");
    }

    /// The calls a reply in `template`'s syntax holds (text outside calls must be empty).
    fn parse(template: &str, text: &str) -> Vec<FunctionCall> {
        let (content, _, calls) = if CallForm::of_template(template) == Some(CallForm::Harmony) {
            ReplyParser::harmony(true).parse_all(text)
        } else {
            ReplyParser::plain(ToolSyntax::of_template(template), &tools()).parse_all(text)
        };
        assert!(content.trim().is_empty(), "{text:?} left {content:?}");
        calls
    }

    /// Whether the tokenizer's encoding of `text` passes the grammar's mask token by token
    /// and ends it.
    /// Markers are read as their tokens, except on the gpt_oss fixture, whose `<|end|>` is a
    /// control token (gpt-oss's own vocabulary, with `<|call|>`, has it as text): there spelled.
    fn accepts(grammars: &Grammars, tok: &Tokenizer, grammar: &str, text: &str) -> bool {
        let mut c = grammars.compile(&Grammar::Lark(grammar.to_owned())).unwrap();
        let mut logits = vec![0.0f32; tok.vocab_size()];
        let parse_special = tok.token_id("<|call|>").is_some() || tok.token_id("<|end|>").is_none();
        for t in tok.encode(text, false, parse_special).unwrap() {
            logits.fill(0.0);
            c.mask(&mut logits).unwrap();
            if !logits[t as usize].is_finite() || c.commit(t).is_err() {
                return false;
            }
        }
        c.is_accepting()
    }

    /// A reply drawn from the grammar alone: each step a random allowed token, until the
    /// grammar ends or `limit` steps (then `None`).
    fn sample(grammars: &Grammars, tok: &Tokenizer, grammar: &str, seed: u64, limit: usize) -> Option<String> {
        let mut c = grammars.compile(&Grammar::Lark(grammar.to_owned())).unwrap();
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let mut ids = Vec::new();
        let mut logits = vec![0.0f32; tok.vocab_size()];
        for _ in 0..limit {
            if c.is_done() {
                return Some(String::from_utf8(tok.detokenize(&ids, false, true).unwrap()).unwrap());
            }
            logits.fill(0.0);
            c.mask(&mut logits).unwrap();
            let allowed: Vec<u32> = (0..logits.len() as u32).filter(|&i| logits[i as usize].is_finite()).collect();
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let t = allowed[(state >> 33) as usize % allowed.len()];
            if tok.is_eog(t) {
                return Some(String::from_utf8(tok.detokenize(&ids, false, true).unwrap()).unwrap());
            }
            c.commit(t).unwrap();
            ids.push(t);
        }
        None
    }

    /// One syntax's cases: a well-formed call, and calls the grammar must refuse.
    struct Case {
        template: &'static str,
        family: &'static str,
        good: String,
        bad: Vec<(&'static str, String)>,
    }

    fn cases() -> Vec<Case> {
        let xml = |name: &str, params: &[(&str, &str)]| {
            let params: String = params.iter().map(|(k, v)| format!("<parameter={k}>\n{v}\n</parameter>\n")).collect();
            format!("<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>")
        };
        let glm = |lines: bool| {
            move |name: &str, params: &[(&str, &str)]| {
                let nl = if lines { "\n" } else { "" };
                let params: String = params
                    .iter()
                    .map(|(k, v)| format!("{nl}<arg_key>{k}</arg_key>{nl}<arg_value>{v}</arg_value>"))
                    .collect();
                format!("<tool_call>{name}{params}{nl}</tool_call>")
            }
        };
        let gemma = |name: &str, params: &[(&str, &str)]| {
            let params: Vec<String> = params.iter().map(|(k, v)| format!("{k}:{v}")).collect();
            format!("<|tool_call>call:{name}{{{}}}<tool_call|>", params.join(","))
        };
        // llguidance writes JSON keys in the schema's order.
        let harmony = |name: &str, params: &[(&str, &str)]| {
            let order = ["city", "unit", "days", "detailed"];
            let mut params = params.to_vec();
            params.sort_by_key(|(k, _)| order.iter().position(|o| o == k).unwrap_or(order.len()));
            let params: Vec<String> = params.iter().map(|(k, v)| format!("\"{k}\": {v}")).collect();
            format!(
                "<|channel|>analysis<|message|>Weather wanted.<|end|><|start|>assistant<|channel|>commentary \
                 to=functions.{name} <|constrain|>json<|message|>{{{}}}",
                params.join(", ")
            )
        };
        let q = |s: &str| format!("<|\"|>{s}<|\"|>");
        let j = |s: &str| format!("\"{s}\"");
        let text = |s: &str| s.to_owned();
        type Write<'a> = &'a dyn Fn(&str, &[(&str, &str)]) -> String;
        let build = |template, family, write: Write, s: &dyn Fn(&str) -> String| {
            let (oslo, celsius, three) = (s("Oslo"), s("celsius"), s("three"));
            Case {
                template,
                family,
                good: write("get_weather", &[("unit", &celsius), ("city", &oslo), ("days", "3"), ("detailed", "true")]),
                bad: vec![
                    ("an undeclared function", write("get_news", &[("city", &oslo), ("unit", &celsius)])),
                    ("a missing required key", write("get_weather", &[("city", &oslo), ("days", "3")])),
                    ("an undeclared key", write("get_weather", &[("city", &oslo), ("unit", &celsius), ("wind", "3")])),
                    ("a text integer", write("get_weather", &[("city", &oslo), ("unit", &celsius), ("days", &three)])),
                    ("a value outside the enum", write("get_weather", &[("city", &oslo), ("unit", &s("kelvin"))])),
                    ("a key twice", write("get_weather", &[("city", &oslo), ("unit", &celsius), ("city", &oslo)])),
                    (
                        "a string over maxLength",
                        write("get_weather", &[("city", &s("Llanfairpwllgwyngyll")), ("unit", &celsius)]),
                    ),
                ],
            }
        };
        vec![
            build(QWEN35, "qwen3_5_moe", &xml, &text),
            build(QWEN3_CODER, "qwen3_5_moe", &xml, &text),
            build(GLM46, "qwen3_5_moe", &glm(true), &text),
            build(GLM47, "qwen3_5_moe", &glm(false), &text),
            build(GEMMA4, "gemma4", &gemma, &q),
            build(GPT_OSS, "gpt_oss", &harmony, &j),
        ]
    }

    #[test]
    fn each_syntax_holds_calls_to_the_declared_functions_and_parameters() {
        for case in cases() {
            let form = CallForm::of_template(case.template).unwrap();
            let tok = tokenizer(case.family);
            let grammars = Grammars::new(&tok).unwrap();
            let grammar = forced_calls_grammar(case.template, &tools(), false).unwrap();
            assert!(accepts(&grammars, &tok, &grammar, &case.good), "{form:?} refuses {:?}\n{grammar}", case.good);
            let calls = parse(case.template, &case.good);
            assert_eq!(calls.len(), 1, "{form:?}: {:?}", case.good);
            assert_eq!(calls[0].arguments, json!({"city": "Oslo", "unit": "celsius", "days": 3, "detailed": true}));
            check_call(&calls[0]);
            for (what, bad) in &case.bad {
                assert!(!accepts(&grammars, &tok, &grammar, bad), "{form:?} takes {what}: {bad:?}");
            }
            // Named: the other function only.
            let named = forced_calls_grammar(case.template, &tools()[1..], false).unwrap();
            assert!(!accepts(&grammars, &tok, &named, &case.good), "{form:?}: a call of an unnamed function");
        }
    }

    #[test]
    fn sampled_replies_parse_back_into_valid_calls() {
        for case in cases() {
            let form = CallForm::of_template(case.template).unwrap();
            let tok = tokenizer(case.family);
            let grammars = Grammars::new(&tok).unwrap();
            let parallel = form != CallForm::Harmony;
            let grammar = forced_calls_grammar(case.template, &tools(), parallel).unwrap();
            let mut done = 0;
            for seed in 0..12 {
                let Some(text) = sample(&grammars, &tok, &grammar, seed, 600) else { continue };
                // JSON strings may hold harmony's markers, which end a message as harmony reads it.
                let arguments = text.rsplit_once("json<|message|>").map_or("", |(_, a)| a);
                if form == CallForm::Harmony && arguments.contains("<|") {
                    continue;
                }
                let calls = parse(case.template, &text);
                assert!(!calls.is_empty(), "{form:?}: {text:?}");
                calls.iter().for_each(check_call);
                done += 1;
            }
            println!("{form:?}: {done} of 12 sampled replies ended within 600 tokens");
            assert!(done >= 3, "{form:?}: {done} sampled replies ended");
        }
    }

    #[test]
    fn templates_without_a_syntax_we_read_have_no_grammar() {
        let gemma3 = include_str!("../../tests/data/chat/templates/google-gemma-3-it.jinja");
        let minimax = include_str!("../../tests/data/chat/templates/MiniMax-M2.jinja");
        for template in [gemma3, minimax] {
            assert!(forced_calls_grammar(template, &tools(), true).is_none());
        }
        assert!(forced_calls_grammar(QWEN35, &[], true).is_none());
    }
}

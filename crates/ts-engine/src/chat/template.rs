//! The Jinja environment transformers renders chat templates in, rebuilt on
//! minijinja. Facts from transformers' `utils/chat_template_utils.py`
//! (`_compile_jinja_template`, `render_jinja_template`):
//!
//! - `trim_blocks` and `lstrip_blocks` on, the trailing newline dropped
//!   (jinja2's default), the `loopcontrols` extension (`break`/`continue`);
//! - `raise_exception(msg)`, `strftime_now(fmt)`, and a `tojson` filter that
//!   is Python's `json.dumps(x, ensure_ascii=False, indent=None,
//!   separators=None, sort_keys=False)`;
//! - `{% generation %}` blocks, which only mark assistant text, render their body;
//! - the render variables are `messages`, `tools` and `documents` (none here),
//!   `add_generation_prompt`, the special tokens and any extra arguments.
//!
//! Floats print as Python prints them. Python's string, list and dict methods
//! come from minijinja-contrib's `pycompat`, with a few more it lacks added
//! here; the `iterable` and `sequence` tests follow jinja2 where minijinja
//! differs.
//!
//! Known gaps, unused by the templates tested: Python's `%` string
//! formatting operator, `\U`/`\N{..}` escapes in string literals, rare
//! methods (`zfill`, `ljust`, `list.index`), and floats nested in printed
//! lists use Rust's notation.

use minijinja::value::{Kwargs, Serde, Value, ValueKind, from_args};
use minijinja::{Environment, Error, ErrorKind, State, UndefinedBehavior};
use serde::Serialize;

use super::clock::DateTime;
use super::{ChatError, ChatMessage, json};

const TEMPLATE_NAME: &str = "chat_template";

/// llama.cpp's fallback for models without a template (`CHATML_TEMPLATE_SRC`
/// in `common/chat.cpp`): ChatML turns `<|im_start|>{role}\n{content}<|im_end|>\n`.
const CHATML_SOURCE: &str = "{%- for message in messages -%}\n\
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n\
    {%- endfor -%}\n\
    {%- if add_generation_prompt -%}\n\
    {{- '<|im_start|>assistant\\n' -}}\n\
    {%- endif -%}";

/// A compiled chat template with the special-token text it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("source_len", &self.source.len())
            .finish_non_exhaustive()
    }
}

/// Extra variables for a template, such as `enable_thinking` (Qwen3) or
/// `reasoning_effort` (gpt-oss), in the order given.
#[derive(Clone, Debug, Default)]
pub struct TemplateKwargs {
    values: Vec<(String, Value)>,
}

impl TemplateKwargs {
    pub fn new() -> TemplateKwargs {
        TemplateKwargs::default()
    }

    /// Adds (or replaces) a variable; any serde-serializable value.
    pub fn set(mut self, name: impl Into<String>, value: impl Serialize) -> Result<TemplateKwargs, ChatError> {
        let name = name.into();
        let value = Value::from(Serde(&value));
        if value.kind() == ValueKind::Invalid {
            return Err(ChatError::BadKwarg { problem: format!("{value}"), name });
        }
        self.values.retain(|(n, _)| *n != name);
        self.values.push((name, value));
        Ok(self)
    }

    /// Every member of a JSON object, e.g. an OpenAI request's `chat_template_kwargs`.
    pub fn from_json(object: &serde_json::Map<String, serde_json::Value>) -> Result<TemplateKwargs, ChatError> {
        object.iter().try_fold(TemplateKwargs::new(), |kwargs, (name, value)| kwargs.set(name, value))
    }
}

impl ChatTemplate {
    /// Compiles `source`; errors say what and where the template problem is.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate, ChatError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| ChatError::Compile(describe(&e)))?;
        env.set_syntax(syntax);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.set_unknown_method_callback(python_method);
        env.set_formatter(python_formatter);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_filter("tojson", tojson);
        env.add_filter("truncate", truncate);
        env.add_function("raise_exception", raise_exception);
        env.add_test("iterable", is_iterable);
        env.add_test("sequence", is_sequence);
        let mut template = ChatTemplate {
            env,
            source: source.to_owned(),
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
        };
        template.set_clock(None);
        template
            .env
            .add_template_owned(TEMPLATE_NAME, rewrite_generation_blocks(source))
            .map_err(|e| ChatError::Compile(describe(&e)))?;
        Ok(template)
    }

    /// The template of a GGUF file (`tokenizer.chat_template`) with its
    /// vocabulary's BOS/EOS text; `None` when the file has none.
    pub fn from_metadata(
        metadata: &ts_gguf::Metadata,
        tokenizer: &ts_tokenizer::Tokenizer,
    ) -> Result<Option<ChatTemplate>, ChatError> {
        let Some(source) = metadata.str("tokenizer.chat_template")? else {
            return Ok(None);
        };
        let token_text = |id: Option<u32>| id.and_then(|id| tokenizer.token_text(id).ok()).unwrap_or("").to_owned();
        let bos = token_text(tokenizer.bos());
        let eos = token_text(tokenizer.eos());
        ChatTemplate::new(source, &bos, &eos).map(Some)
    }

    /// The ChatML template llama.cpp falls back to for a model without one.
    pub fn chatml() -> ChatTemplate {
        ChatTemplate::new(CHATML_SOURCE, "", "").expect("the ChatML template compiles")
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    /// What `strftime_now` formats: the given time, or `None` for the system
    /// clock in UTC (transformers uses local time; UTC needs no time-zone data).
    pub fn set_clock(&mut self, fixed: Option<DateTime>) {
        self.env.add_function("strftime_now", move |format: &str| -> Result<String, Error> {
            let now = fixed.unwrap_or_else(DateTime::now_utc);
            Ok(now.strftime(format))
        });
    }

    /// Renders the conversation; with `add_generation_prompt` the text ends
    /// where the assistant's reply begins.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, ChatError> {
        self.render_with(messages, add_generation_prompt, &TemplateKwargs::new())
    }

    /// [`ChatTemplate::render`] with extra template variables.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &TemplateKwargs,
    ) -> Result<String, ChatError> {
        let template = self.env.get_template(TEMPLATE_NAME).map_err(|e| ChatError::Compile(describe(&e)))?;
        let mut context: Vec<(String, Value)> = vec![
            ("messages".into(), Value::from(Serde(messages))),
            ("tools".into(), Value::from(())),
            ("documents".into(), Value::from(())),
            ("add_generation_prompt".into(), Value::from(add_generation_prompt)),
            ("bos_token".into(), Value::from(self.bos_token.as_str())),
            ("eos_token".into(), Value::from(self.eos_token.as_str())),
        ];
        for (name, value) in &kwargs.values {
            context.retain(|(n, _)| n != name);
            context.push((name.clone(), value.clone()));
        }
        template.render(Value::from_pairs(context)).map_err(|e| render_error(&e))
    }
}

/// The message a template passed to `raise_exception`, carried as the
/// minijinja error's source so that it can be told apart from engine errors.
#[derive(Debug)]
struct RaisedByTemplate(String);

impl std::fmt::Display for RaisedByTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedByTemplate {}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(RaisedByTemplate(message)))
}

fn render_error(error: &Error) -> ChatError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = source {
        if let Some(raised) = e.downcast_ref::<RaisedByTemplate>() {
            return ChatError::Raised(raised.0.clone());
        }
        source = e.source();
    }
    ChatError::Render(describe(error))
}

/// The error with its chain of causes on one line.
fn describe(error: &Error) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(e) = source {
        text.push_str(": ");
        text.push_str(&e.to_string());
        source = e.source();
    }
    text
}

/// transformers' `tojson`: `json.dumps` with its keyword arguments, and the
/// positional order of its Python signature (`ensure_ascii`, `indent`).
fn tojson(value: &Value, ensure_ascii: Option<Value>, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let ensure_ascii = kwargs.get::<Option<Value>>("ensure_ascii")?.or(ensure_ascii);
    let indent = kwargs.get::<Option<Value>>("indent")?.or(indent);
    let separators = kwargs.get::<Option<Value>>("separators")?;
    let sort_keys = kwargs.get::<Option<Value>>("sort_keys")?;
    kwargs.assert_all_used()?;
    let options = json::DumpOptions::from_python_args(
        ensure_ascii.is_some_and(|v| v.is_true()),
        indent.filter(|v| !v.is_none()),
        separators.filter(|v| !v.is_none()),
        sort_keys.is_some_and(|v| v.is_true()),
    )?;
    json::dumps(value, &options).map(Value::from)
}

/// Prints values as Python's `str` does where minijinja differs: floats as
/// `repr` (`1e+20`, `inf`) rather than Rust's positional notation.
fn python_formatter(out: &mut minijinja::Output, state: &mut State, value: &Value) -> Result<(), Error> {
    if value.is_number() && !value.is_integer() {
        let x = f64::try_from(value.clone())?;
        out.write_str(&json::python_float_repr(x)).map_err(|e| Error::new(ErrorKind::WriteFailure, e.to_string()))
    } else {
        minijinja::escape_formatter(out, state, value)
    }
}

/// jinja2's `truncate(s, length=255, killwords=False, end='...', leeway=5)`:
/// strings within `length + leeway` characters stay whole; longer ones are
/// cut to `length - len(end)` characters (back to the last space unless
/// `killwords`) and get `end`.
fn truncate(
    value: &str,
    length: Option<usize>,
    killwords: Option<bool>,
    end: Option<&str>,
    kwargs: Kwargs,
) -> Result<String, Error> {
    let length = kwargs.get::<Option<usize>>("length")?.or(length).unwrap_or(255);
    let killwords = kwargs.get::<Option<bool>>("killwords")?.or(killwords).unwrap_or(false);
    let end = kwargs.get::<Option<&str>>("end")?.or(end).unwrap_or("...");
    let leeway = kwargs.get::<Option<usize>>("leeway")?.unwrap_or(5);
    kwargs.assert_all_used()?;
    let end_len = end.chars().count();
    if length < end_len {
        return Err(Error::new(ErrorKind::InvalidOperation, "truncate length is shorter than its end marker"));
    }
    if value.chars().count() <= length + leeway {
        return Ok(value.to_owned());
    }
    let kept: String = value.chars().take(length - end_len).collect();
    let kept = if killwords { kept.as_str() } else { kept.rsplit_once(' ').map_or(kept.as_str(), |(head, _)| head) };
    Ok(format!("{kept}{end}"))
}

/// jinja2's `iterable` test, `iter(value)` succeeding: not for none or
/// numbers (minijinja iterates none as empty), but for undefined.
fn is_iterable(value: &Value) -> bool {
    value.is_undefined()
        || matches!(
            value.kind(),
            ValueKind::String | ValueKind::Bytes | ValueKind::Seq | ValueKind::Map | ValueKind::Iterable
        )
}

/// jinja2's `sequence` test, having a length and `__getitem__`: strings and
/// dicts too, and undefined.
fn is_sequence(value: &Value) -> bool {
    value.is_undefined()
        || matches!(value.kind(), ValueKind::String | ValueKind::Bytes | ValueKind::Seq | ValueKind::Map)
}

/// Python methods minijinja lacks, then minijinja-contrib's `pycompat` ones.
fn python_method(state: &mut State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        match method {
            "rsplit" => {
                let (sep, maxsplit): (Option<&str>, Option<i64>) = from_args(args)?;
                return Ok(rsplit(s, sep, maxsplit.filter(|&m| m >= 0).map(|m| m as usize)));
            }
            "partition" | "rpartition" => {
                let (sep,): (&str,) = from_args(args)?;
                if sep.is_empty() {
                    return Err(Error::new(ErrorKind::InvalidOperation, "empty separator"));
                }
                let found = if method == "partition" { s.find(sep) } else { s.rfind(sep) };
                let parts: [&str; 3] = match (found, method) {
                    (Some(i), _) => [&s[..i], sep, &s[i + sep.len()..]],
                    (None, "partition") => [s, "", ""],
                    (None, _) => ["", "", s],
                };
                return Ok(Value::from(parts.map(Value::from).to_vec()));
            }
            "title" => {
                let () = from_args(args)?;
                return Ok(Value::from(python_title(s)));
            }
            "removeprefix" => {
                let (prefix,): (&str,) = from_args(args)?;
                return Ok(Value::from(s.strip_prefix(prefix).unwrap_or(s)));
            }
            "removesuffix" => {
                let (suffix,): (&str,) = from_args(args)?;
                return Ok(Value::from(s.strip_suffix(suffix).unwrap_or(s)));
            }
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// Python's `str.title`: a letter is upper-cased when the character before
/// it is not cased (so "‘quotes’" and "</think>" get capitals), else
/// lower-cased. Title case is approximated as upper case with the tail of a
/// multi-character mapping lowered ("ﬁ" → "Fi", "ß" → "Ss").
fn python_title(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut previous_is_cased = false;
    for c in s.chars() {
        if previous_is_cased {
            out.extend(c.to_lowercase());
        } else {
            let mut upper = c.to_uppercase();
            out.extend(upper.next());
            out.extend(upper.flat_map(char::to_lowercase));
        }
        previous_is_cased = c.is_lowercase() || c.is_uppercase();
    }
    out
}

/// Python's `str.rsplit`: on whitespace runs when `sep` is none, at most
/// `maxsplit` splits counted from the right.
fn rsplit(s: &str, sep: Option<&str>, maxsplit: Option<usize>) -> Value {
    let limit = maxsplit.unwrap_or(usize::MAX);
    let mut parts: Vec<&str> = Vec::new();
    match sep {
        Some(sep) if !sep.is_empty() => {
            let mut rest = s;
            while parts.len() < limit {
                match rest.rfind(sep) {
                    Some(i) => {
                        parts.push(&rest[i + sep.len()..]);
                        rest = &rest[..i];
                    }
                    None => break,
                }
            }
            parts.push(rest);
        }
        _ => {
            let mut rest = s.trim_end();
            while !rest.is_empty() {
                if parts.len() == limit {
                    parts.push(rest);
                    break;
                }
                match rest.rfind(char::is_whitespace) {
                    Some(i) => {
                        let ws_len = rest[i..].chars().next().map_or(1, char::len_utf8);
                        parts.push(&rest[i + ws_len..]);
                        rest = rest[..i].trim_end();
                    }
                    None => {
                        parts.push(rest);
                        break;
                    }
                }
            }
        }
    }
    parts.reverse();
    Value::from(parts.into_iter().map(Value::from).collect::<Vec<_>>())
}

/// `{% generation %}`/`{% endgeneration %}` (transformers' assistant-mask
/// extension) become `{% with %}`/`{% endwith %}`: a scope that renders its
/// body, keeping the tag's whitespace-control marks.
fn rewrite_generation_blocks(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let after_open = &tag[2..];
        let marker_len = usize::from(after_open.starts_with(['-', '+']));
        let body = &after_open[marker_len..];
        let word_start = body.len() - body.trim_start().len();
        let word = &body[word_start..];
        let replacement = [("endgeneration", "endwith"), ("generation", "with")].into_iter().find(|(name, _)| {
            word.starts_with(name)
                && word[name.len()..].trim_start().starts_with(['-', '+', '%'])
                && !word[name.len()..].starts_with(|c: char| c.is_alphanumeric() || c == '_')
        });
        match replacement {
            Some((name, with)) => {
                out.push_str(&tag[..2 + marker_len + word_start]);
                out.push_str(with);
                rest = &word[name.len()..];
            }
            None => {
                out.push_str("{%");
                rest = after_open;
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_blocks_become_with_blocks() {
        assert_eq!(
            rewrite_generation_blocks("a{%- generation -%}b{% endgeneration %}c{% set generation_x = 1 %}"),
            "a{%- with -%}b{% endwith %}c{% set generation_x = 1 %}"
        );
    }

    #[test]
    fn rsplit_follows_python() {
        let split = |s, sep, max| rsplit(s, sep, max).to_string();
        assert_eq!(split("a,b,c", Some(","), Some(1)), r#"["a,b", "c"]"#.replace('"', "'"));
        assert_eq!(split("  a  b c ", None, None), "['a', 'b', 'c']");
        assert_eq!(split("  a  b c ", None, Some(1)), "['  a  b', 'c']");
        assert_eq!(split("abc", Some("x"), None), "['abc']");
    }
}

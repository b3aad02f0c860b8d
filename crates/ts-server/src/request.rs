//! Request bodies as typed serde structs. A body is read into the structs of
//! its endpoint, each from the whole JSON object (fields the server does not
//! know are ignored, as llama-server and vLLM ignore them); a field of the
//! wrong type is answered with an OpenAI error naming it (its path, as
//! `messages[0].content`). Ranges and cross-field rules are checked after.

use crate::api::ApiError;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use ts_engine::chat::ChatMessage;

/// `T` read from `v`, or an error naming the field at fault under `prefix`.
pub fn typed<T: DeserializeOwned>(v: &Value, prefix: &str) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let param = match (prefix, path.as_str()) {
            (p, ".") => p.to_owned(),
            ("", path) => path.to_owned(),
            (p, path) if path.starts_with('[') => format!("{p}{path}"),
            (p, path) => format!("{p}.{path}"),
        };
        ApiError::bad_field(format!("'{param}' is invalid: {}", e.into_inner()), param)
    })
}

/// Fields every generation request shares: OpenAI's, then llama-server's extensions.
#[derive(Deserialize, Default)]
#[serde(default)]
pub struct Generation {
    pub model: Option<String>,
    pub n: Option<u64>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    /// Any JSON integer: negative ones wrap (as llama-server takes them).
    pub seed: Option<serde_json::Number>,
    pub stop: Option<Stop>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub response_format: Option<ResponseFormat>,
    /// The legacy function-calling fields, refused by name.
    pub functions: Option<Value>,
    pub function_call: Option<Value>,
    pub top_k: Option<u64>,
    pub min_p: Option<f64>,
    pub repeat_penalty: Option<f64>,
    /// Token id (as text) to bias.
    pub logit_bias: Option<BTreeMap<String, f64>>,
    #[serde(rename = "speculative.n_max")]
    pub spec_max: Option<u64>,
    #[serde(rename = "speculative.n_min")]
    pub spec_min: Option<u64>,
}

/// `stop`: one sequence or several.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// `response_format`: `text`, `json_object` or `json_schema`.
#[derive(Deserialize)]
pub struct ResponseFormat {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub json_schema: Option<JsonSchemaFormat>,
}

/// `response_format.json_schema`. The schema is enforced whatever `strict` says
/// (as llama-server does); without one, any JSON value.
#[derive(Deserialize)]
pub struct JsonSchemaFormat {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub schema: Option<Map<String, Value>>,
    #[serde(default)]
    pub strict: Option<bool>,
}

/// `/v1/completions`' own fields.
#[derive(Deserialize, Default)]
#[serde(default)]
pub struct CompletionFields {
    /// A string, one string in an array, or token ids (checked by the handler).
    pub prompt: Option<Value>,
    pub echo: Option<bool>,
    /// Alternatives per token, 0 to 5.
    pub logprobs: Option<u64>,
    pub suffix: Option<String>,
    pub best_of: Option<u64>,
}

/// `/v1/chat/completions`' own fields.
#[derive(Deserialize, Default)]
#[serde(default)]
pub struct ChatFields {
    pub messages: Option<Vec<ChatMessage>>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u64>,
    /// Declarations as the client wrote them (the template sees them so);
    /// each is checked as a [`ToolDecl`].
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<ToolChoiceField>,
    pub parallel_tool_calls: Option<bool>,
}

/// One entry of `tools`.
#[derive(Deserialize)]
pub struct ToolDecl {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionDecl,
}

#[derive(Deserialize)]
pub struct FunctionDecl {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
    /// A JSON schema object.
    #[serde(default)]
    pub parameters: Option<Map<String, Value>>,
    #[serde(default)]
    pub strict: Option<bool>,
}

/// `tool_choice` as sent: `"none"`, `"auto"`, `"required"`, or a named function.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum ToolChoiceField {
    Mode(String),
    Named {
        #[serde(rename = "type")]
        kind: String,
        function: NamedFunction,
    },
}

#[derive(Deserialize)]
pub struct NamedFunction {
    pub name: String,
}

/// What the request's tools ask of the reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// No tools are shown to the model and nothing is parsed.
    None,
    /// The model may call one.
    Auto,
    /// The reply is one or more calls (constrained to the tools' syntax and parameters).
    Required,
    /// The reply is a call of this one, the only tool the model is shown (constrained).
    Function(String),
}

/// The request's tools, checked: what the template is given, and the choice.
pub struct ChatTools {
    /// Declarations for the template (empty for none).
    pub declared: Vec<Value>,
    pub choice: ToolChoice,
    /// At most one call per reply when false.
    pub parallel: bool,
}

/// OpenAI's rule for function names: letters, digits, `_` and `-`, at most 64.
fn valid_function_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 64 && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

impl ChatFields {
    /// `tools`, `tool_choice` and `parallel_tool_calls` checked together.
    pub fn tools(&self) -> Result<ChatTools, ApiError> {
        let tools = self.tools.clone().unwrap_or_default();
        let mut names = Vec::with_capacity(tools.len());
        for (i, tool) in tools.iter().enumerate() {
            let at = format!("tools[{i}]");
            let decl: ToolDecl = typed(tool, &at)?;
            if decl.kind != "function" {
                return Err(ApiError::bad_field(
                    format!("'{at}.type' is '{}'; only 'function' tools exist", decl.kind),
                    format!("{at}.type"),
                ));
            }
            let name = decl.function.name;
            if !valid_function_name(&name) {
                return Err(ApiError::bad_field(
                    format!("'{at}.function.name' is '{name}'; a name is 1 to 64 letters, digits, '_' or '-'"),
                    format!("{at}.function.name"),
                ));
            }
            if names.contains(&name) {
                return Err(ApiError::bad_field(
                    format!("'{at}.function.name': '{name}' is declared twice"),
                    format!("{at}.function.name"),
                ));
            }
            names.push(name);
        }
        let choice = match &self.tool_choice {
            None if tools.is_empty() => ToolChoice::None,
            None => ToolChoice::Auto,
            Some(ToolChoiceField::Mode(m)) => match m.as_str() {
                "none" => ToolChoice::None,
                "auto" => ToolChoice::Auto,
                "required" => ToolChoice::Required,
                other => {
                    return Err(ApiError::bad(
                        format!(
                            "'tool_choice' is '{other}'; it must be 'none', 'auto', 'required' or a named function"
                        ),
                        Some("tool_choice"),
                    ));
                }
            },
            Some(ToolChoiceField::Named { kind, function }) => {
                if kind != "function" {
                    return Err(ApiError::bad(
                        format!("'tool_choice.type' is '{kind}'; it must be 'function'"),
                        Some("tool_choice"),
                    ));
                }
                if !names.contains(&function.name) {
                    return Err(ApiError::bad(
                        format!("'tool_choice' names '{}', which 'tools' does not declare", function.name),
                        Some("tool_choice"),
                    ));
                }
                ToolChoice::Function(function.name.clone())
            }
        };
        if tools.is_empty() && choice != ToolChoice::None {
            return Err(ApiError::bad("'tool_choice' needs 'tools'", Some("tool_choice")));
        }
        let declared = match &choice {
            ToolChoice::None => Vec::new(),
            ToolChoice::Auto | ToolChoice::Required => tools,
            ToolChoice::Function(name) => {
                tools.into_iter().zip(&names).filter(|(_, n)| *n == name).map(|(t, _)| t).collect()
            }
        };
        Ok(ChatTools { declared, choice, parallel: self.parallel_tool_calls.unwrap_or(true) })
    }
}

/// `/tokenize`'s body.
#[derive(Deserialize, Default)]
#[serde(default)]
pub struct TokenizeBody {
    pub content: Option<String>,
    pub prompt: Option<String>,
    pub add_special: Option<bool>,
    pub add_special_tokens: Option<bool>,
    pub with_pieces: Option<bool>,
}

/// `/detokenize`'s body.
#[derive(Deserialize, Default)]
#[serde(default)]
pub struct DetokenizeBody {
    pub tokens: Option<Vec<u64>>,
}

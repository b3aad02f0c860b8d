//! Chat prompts and replies: rendering a conversation with the model's Jinja
//! chat template the way Hugging Face transformers' `apply_chat_template`
//! does, and reading replies back: gpt-oss's harmony format, tool calls.

mod clock;
mod forced_calls;
pub mod harmony;
mod json;
pub mod reply;
mod template;
pub mod tool_calls;

pub use clock::DateTime;
pub use template::{ChatTemplate, TemplateKwargs};

use serde::{Deserialize, Deserializer, Serialize};

/// One turn of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// The text. OpenAI-style content (a string, a list of parts, or null)
    /// deserializes into it: text parts joined by newlines.
    #[serde(deserialize_with = "deserialize_content", default)]
    pub content: String,
    /// An assistant turn's reasoning, for templates that render it (Qwen3.5's
    /// `<think>` block) when a client sends it back; absent from the template's
    /// view when not given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// An assistant turn's calls of the request's tools.
    #[serde(default, deserialize_with = "null_as_default", skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// A tool result's call (`role: "tool"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool result's function name, which some templates print.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            reasoning_content: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }

    pub fn system(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("system", content)
    }

    pub fn user(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("user", content)
    }

    pub fn assistant(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("assistant", content)
    }

    /// A message whose content arrives as parts: the `text` parts joined by
    /// newlines, others (images, audio) left out, as llama.cpp's server joins
    /// them for templates that take plain strings (`common/chat.cpp`).
    pub fn from_parts(role: impl Into<String>, parts: &[ContentPart]) -> ChatMessage {
        ChatMessage::new(role, join_text_parts(parts))
    }
}

/// A call of a tool, in an assistant message (OpenAI's `tool_calls` entry).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    pub function: FunctionCall,
}

fn function_kind() -> String {
    "function".into()
}

/// A function's name and arguments. Arguments a client sends as a JSON string
/// (OpenAI's form) are held parsed, as vLLM and llama.cpp hand them to
/// templates (which print them with `tojson` or walk their keys); a string
/// that is not JSON stays a string.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    #[serde(deserialize_with = "deserialize_arguments", default = "no_arguments")]
    pub arguments: serde_json::Value,
}

impl FunctionCall {
    /// The arguments as OpenAI sends them: JSON text.
    pub fn arguments_json(&self) -> String {
        match &self.arguments {
            serde_json::Value::String(s) => s.clone(),
            v => v.to_string(),
        }
    }
}

fn no_arguments() -> serde_json::Value {
    serde_json::Value::Object(serde_json::Map::new())
}

fn deserialize_arguments<'de, D: Deserializer<'de>>(deserializer: D) -> Result<serde_json::Value, D::Error> {
    Ok(match Option::<serde_json::Value>::deserialize(deserializer)? {
        None => no_arguments(),
        Some(serde_json::Value::String(s)) if s.trim().is_empty() => no_arguments(),
        Some(serde_json::Value::String(s)) => serde_json::from_str(&s).unwrap_or(serde_json::Value::String(s)),
        Some(v) => v,
    })
}

/// One element of list-valued message content, as in OpenAI's chat API.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

impl ContentPart {
    pub fn text(text: impl Into<String>) -> ContentPart {
        ContentPart { kind: "text".into(), text: Some(text.into()) }
    }
}

/// The text of `type: "text"` parts, joined by newlines.
pub fn join_text_parts(parts: &[ContentPart]) -> String {
    let texts: Vec<&str> = parts.iter().filter(|p| p.kind == "text").filter_map(|p| p.text.as_deref()).collect();
    texts.join("\n")
}

/// `null` read as the type's default (OpenAI clients send `"tool_calls": null`).
fn null_as_default<'de, D: Deserializer<'de>, T: Default + Deserialize<'de>>(deserializer: D) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

fn deserialize_content<'de, D: Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Content {
        Text(String),
        Parts(Vec<ContentPart>),
    }
    Ok(match Option::<Content>::deserialize(deserializer)? {
        None => String::new(),
        Some(Content::Text(text)) => text,
        Some(Content::Parts(parts)) => join_text_parts(&parts),
    })
}

/// What can go wrong building or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("chat template does not compile: {0}")]
    Compile(String),
    /// The template called `raise_exception(message)`, typically to reject a
    /// conversation shape (a system turn, roles that do not alternate).
    #[error("chat template rejected the conversation: {0}")]
    Raised(String),
    #[error("chat template failed to render: {0}")]
    Render(String),
    #[error("template argument '{name}' cannot be passed to the template: {problem}")]
    BadKwarg { name: String, problem: String },
    #[error(transparent)]
    Gguf(#[from] ts_gguf::GgufError),
}

//! Chat prompts and replies: rendering a conversation with the model's Jinja
//! chat template the way Hugging Face transformers' `apply_chat_template`
//! does, and reading gpt-oss replies in the harmony format.

mod clock;
pub mod harmony;
mod json;
mod template;

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
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into(), reasoning_content: None }
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

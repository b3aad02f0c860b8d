//! A generated reply sorted as it streams into what the client sees: content,
//! reasoning (gpt-oss's analysis channel) and tool calls, whichever syntax the
//! model writes them in.

use serde_json::Value;

use super::FunctionCall;
use super::harmony::{Channel, HarmonyEvent, HarmonyParser, MessageHeader};
use super::tool_calls::{ToolCallParser, ToolCallPiece, ToolSyntax};

/// One part of a reply, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplyEvent {
    Content(String),
    Reasoning(String),
    ToolCall(FunctionCall),
}

/// Reads a reply piece by piece (see [`ReplyParser::feed`]).
#[derive(Clone, Debug)]
pub enum ReplyParser {
    /// Text, searched for tool calls when a syntax is given.
    Plain(Option<ToolCallParser>),
    /// gpt-oss's harmony messages; with `tools`, a message to `functions.NAME`
    /// is a call of NAME, its content the JSON arguments.
    Harmony { parser: Box<HarmonyParser>, tools: bool, header: Option<MessageHeader>, arguments: String },
}

impl ReplyParser {
    /// A reply of plain text; with `tools`, its calls in `syntax` are read.
    pub fn plain(syntax: Option<ToolSyntax>, tools: &[Value]) -> ReplyParser {
        ReplyParser::Plain(syntax.filter(|_| !tools.is_empty()).map(|s| ToolCallParser::new(s, tools)))
    }

    /// A gpt-oss reply (after a prompt ending in `<|start|>assistant`).
    pub fn harmony(tools: bool) -> ReplyParser {
        ReplyParser::Harmony { parser: Box::new(HarmonyParser::new()), tools, header: None, arguments: String::new() }
    }

    /// Consumes a decoded piece (special tokens as text for harmony).
    pub fn feed(&mut self, text: &str) -> Vec<ReplyEvent> {
        match self {
            ReplyParser::Plain(None) => vec![ReplyEvent::Content(text.to_owned())],
            ReplyParser::Plain(Some(p)) => p.feed(text).into_iter().map(piece_event).collect(),
            ReplyParser::Harmony { parser, .. } => {
                let events = parser.feed(text);
                self.harmony_events(events)
            }
        }
    }

    /// Ends the reply: releases what was held back.
    pub fn finish(&mut self) -> Vec<ReplyEvent> {
        match self {
            ReplyParser::Plain(None) => Vec::new(),
            ReplyParser::Plain(Some(p)) => p.finish().into_iter().map(piece_event).collect(),
            ReplyParser::Harmony { parser, .. } => {
                let mut events = parser.finish();
                // A call's turn ends with `<|call|>`, which the decoding stops at unseen.
                events.push(HarmonyEvent::MessageEnd);
                self.harmony_events(events)
            }
        }
    }

    /// A whole reply: content, reasoning and calls.
    pub fn parse_all(mut self, text: &str) -> (String, String, Vec<FunctionCall>) {
        let mut events = self.feed(text);
        events.extend(self.finish());
        gather(events)
    }

    fn harmony_events(&mut self, events: Vec<HarmonyEvent>) -> Vec<ReplyEvent> {
        let ReplyParser::Harmony { tools, header, arguments, .. } = self else { return Vec::new() };
        let mut out = Vec::new();
        for event in events {
            match event {
                HarmonyEvent::MessageStart(h) => *header = Some(h),
                HarmonyEvent::Content(t) => match header.as_ref() {
                    Some(h) if *tools && function_name(h).is_some() => arguments.push_str(&t),
                    Some(MessageHeader { channel: Channel::Final, .. }) => out.push(ReplyEvent::Content(t)),
                    _ => out.push(ReplyEvent::Reasoning(t)),
                },
                HarmonyEvent::MessageEnd => {
                    let text = std::mem::take(arguments);
                    if let Some(name) = header.take().as_ref().filter(|_| *tools).and_then(function_name) {
                        out.push(match harmony_arguments(&text) {
                            Some(arguments) => ReplyEvent::ToolCall(FunctionCall { name: name.to_owned(), arguments }),
                            None => ReplyEvent::Content(text),
                        });
                    }
                }
                HarmonyEvent::TurnEnd(_) => {}
            }
        }
        out
    }
}

fn piece_event(piece: ToolCallPiece) -> ReplyEvent {
    match piece {
        ToolCallPiece::Text(t) => ReplyEvent::Content(t),
        ToolCallPiece::Call(c) => ReplyEvent::ToolCall(c),
    }
}

/// The function a harmony message is addressed to (`to=functions.NAME`).
fn function_name(header: &MessageHeader) -> Option<&str> {
    header.recipient.as_deref()?.strip_prefix("functions.").filter(|n| !n.is_empty())
}

/// A harmony call's content as JSON-object arguments (empty text is none).
fn harmony_arguments(text: &str) -> Option<Value> {
    if text.trim().is_empty() {
        return Some(Value::Object(serde_json::Map::new()));
    }
    serde_json::from_str::<Value>(text.trim()).ok().filter(Value::is_object)
}

/// Events of a reply gathered into its content, reasoning and calls.
pub fn gather(events: impl IntoIterator<Item = ReplyEvent>) -> (String, String, Vec<FunctionCall>) {
    let (mut content, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
    for event in events {
        match event {
            ReplyEvent::Content(t) => content += &t,
            ReplyEvent::Reasoning(t) => reasoning += &t,
            ReplyEvent::ToolCall(c) => calls.push(c),
        }
    }
    (content, reasoning, calls)
}

//! gpt-oss replies in OpenAI's harmony format, parsed as they stream.
//!
//! Facts from OpenAI's "harmony response format" guide (openai-cookbook,
//! `articles/openai-harmony.md`) and the gpt-oss chat template:
//!
//! - a message is `<|start|>{header}<|message|>{content}` closed by `<|end|>`,
//!   or by `<|return|>` (the final answer is done) or `<|call|>` (a tool call
//!   waits), both of which end the turn;
//! - the prompt ends with `<|start|>assistant`, so a reply begins inside the
//!   header, typically `<|channel|>analysis<|message|>`;
//! - the header holds the role, `<|channel|>` and a channel name (`analysis`
//!   for chain of thought, `commentary` for tool calls and preambles, `final`
//!   for the answer), an optional recipient `to=functions.name` after the role
//!   or the channel, and an optional `<|constrain|>` content type such as `json`.
//!
//! Special tokens arrive as their literal text (decode with special tokens
//! shown); a marker split across pieces is held back until it is complete.
//! The parser is lenient where models slip: a `<|start|>` or `<|channel|>`
//! inside content ends the message first, and text between messages starts a
//! header as if `<|start|>` had been written.

const START: &str = "<|start|>";
const END: &str = "<|end|>";
const MESSAGE: &str = "<|message|>";
const CHANNEL: &str = "<|channel|>";
const CONSTRAIN: &str = "<|constrain|>";
const RETURN: &str = "<|return|>";
const CALL: &str = "<|call|>";

const MARKERS: [&str; 7] = [START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL];

/// The channel a message is written to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Channel {
    /// Chain of thought: not meant for the user.
    Analysis,
    /// Tool calls, and preambles to them meant for the user.
    Commentary,
    /// The answer.
    Final,
    Other(String),
    /// The header named no channel.
    Unspecified,
}

impl Channel {
    fn from_name(name: &str) -> Channel {
        match name {
            "analysis" => Channel::Analysis,
            "commentary" => Channel::Commentary,
            "final" => Channel::Final,
            other => Channel::Other(other.to_owned()),
        }
    }
}

/// A message's header: who writes, on which channel, to whom, in what format.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MessageHeader {
    /// `assistant` unless the header names another role.
    pub role: String,
    pub channel: Channel,
    /// The tool addressed with `to=`, e.g. `functions.get_weather`.
    pub recipient: Option<String>,
    /// The `<|constrain|>` type, e.g. `json`.
    pub content_type: Option<String>,
}

/// How a turn ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TurnEnd {
    /// `<|return|>`: the answer is complete.
    Return,
    /// `<|call|>`: the last message is a tool call to run.
    Call,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HarmonyEvent {
    /// A header is complete; content of this message follows.
    MessageStart(MessageHeader),
    /// Text of the message last started.
    Content(String),
    /// The message is over (`<|end|>`, `<|return|>`, `<|call|>`, or an implied end).
    MessageEnd,
    /// The turn is over: generation should stop. Follows a `MessageEnd`.
    TurnEnd(TurnEnd),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Section {
    Role,
    Channel,
    Constrain,
}

/// A header being read: the text of each section, and everything raw in
/// case the header never completes.
#[derive(Clone, Debug, Default)]
struct HeaderText {
    role: String,
    channel: Option<String>,
    constrain: Option<String>,
    raw: String,
}

impl HeaderText {
    fn push(&mut self, section: Section, text: &str) {
        let target = match section {
            Section::Role => &mut self.role,
            Section::Channel => self.channel.get_or_insert_with(String::new),
            Section::Constrain => self.constrain.get_or_insert_with(String::new),
        };
        target.push_str(text);
        self.raw.push_str(text);
    }

    fn finish(&self, default_role: &str) -> MessageHeader {
        let mut recipient = None;
        let mut role = None;
        for word in self.role.split_whitespace() {
            match word.strip_prefix("to=") {
                Some(to) => recipient = Some(to.to_owned()),
                None if role.is_none() => role = Some(word.to_owned()),
                None => {}
            }
        }
        let mut channel = Channel::Unspecified;
        let mut content_type = self.constrain.as_deref().map(str::trim).filter(|t| !t.is_empty()).map(str::to_owned);
        let mut named_channel = false;
        for word in self.channel.as_deref().unwrap_or("").split_whitespace() {
            match word.strip_prefix("to=") {
                Some(to) => recipient = Some(to.to_owned()),
                None if !named_channel => {
                    channel = Channel::from_name(word);
                    named_channel = true;
                }
                None if content_type.is_none() => content_type = Some(word.to_owned()),
                None => {}
            }
        }
        MessageHeader { role: role.unwrap_or_else(|| default_role.to_owned()), channel, recipient, content_type }
    }
}

#[derive(Clone, Debug)]
enum State {
    /// Reading a header, in the given section.
    Header(HeaderText, Section),
    /// Inside a message's content.
    Content(MessageHeader),
    /// After a message ended, before the next `<|start|>`.
    Between,
}

/// Turns decoded text pieces of a gpt-oss reply into [`HarmonyEvent`]s.
#[derive(Clone, Debug)]
pub struct HarmonyParser {
    state: State,
    /// Text held back because it may be the start of a marker.
    pending: String,
    ended: Option<TurnEnd>,
}

impl Default for HarmonyParser {
    fn default() -> Self {
        HarmonyParser::new()
    }
}

impl HarmonyParser {
    /// A parser for a reply that follows a prompt ending in `<|start|>assistant`.
    pub fn new() -> HarmonyParser {
        HarmonyParser {
            state: State::Header(HeaderText::default(), Section::Role),
            pending: String::new(),
            ended: None,
        }
    }

    /// How the turn ended, once `<|return|>` or `<|call|>` has been seen.
    pub fn turn_end(&self) -> Option<TurnEnd> {
        self.ended
    }

    /// The header of the message being read, if inside one.
    pub fn current_header(&self) -> Option<&MessageHeader> {
        match &self.state {
            State::Content(header) => Some(header),
            _ => None,
        }
    }

    /// Consumes one decoded piece; returns the events it completes.
    pub fn feed(&mut self, piece: &str) -> Vec<HarmonyEvent> {
        let mut events = Vec::new();
        let mut text = std::mem::take(&mut self.pending);
        text.push_str(piece);
        let mut rest = text.as_str();
        loop {
            let Some(at) = rest.find("<|") else {
                // A trailing '<' may begin a marker in the next piece.
                let keep = usize::from(rest.ends_with('<'));
                self.text(&rest[..rest.len() - keep], &mut events);
                rest = &rest[rest.len() - keep..];
                break;
            };
            self.text(&rest[..at], &mut events);
            let tail = &rest[at..];
            if let Some(marker) = MARKERS.iter().find(|m| tail.starts_with(*m)) {
                self.marker(marker, &mut events);
                rest = &tail[marker.len()..];
            } else if MARKERS.iter().any(|m| m.starts_with(tail)) {
                rest = tail;
                break;
            } else {
                self.text("<|", &mut events);
                rest = &tail[2..];
            }
        }
        self.pending = rest.to_owned();
        events
    }

    /// Ends the stream: held-back text is released, and a header that never
    /// reached `<|message|>` (a reply that ignored the format) comes out as
    /// the content of an unspecified-channel message.
    pub fn finish(&mut self) -> Vec<HarmonyEvent> {
        let mut events = Vec::new();
        let pending = std::mem::take(&mut self.pending);
        self.text(&pending, &mut events);
        if let State::Header(header, _) = &self.state
            && !header.raw.trim().is_empty()
        {
            let message = MessageHeader {
                role: "assistant".into(),
                channel: Channel::Unspecified,
                recipient: None,
                content_type: None,
            };
            let raw = header.raw.clone();
            events.push(HarmonyEvent::MessageStart(message));
            events.push(HarmonyEvent::Content(raw));
            self.state = State::Between;
        }
        events
    }

    fn text(&mut self, text: &str, events: &mut Vec<HarmonyEvent>) {
        if text.is_empty() {
            return;
        }
        match &mut self.state {
            State::Header(header, section) => header.push(*section, text),
            State::Content(_) => match events.last_mut() {
                Some(HarmonyEvent::Content(last)) => last.push_str(text),
                _ => events.push(HarmonyEvent::Content(text.to_owned())),
            },
            State::Between => {
                let text = text.trim_start();
                if !text.is_empty() {
                    let mut header = HeaderText::default();
                    header.push(Section::Role, text);
                    self.state = State::Header(header, Section::Role);
                }
            }
        }
    }

    fn marker(&mut self, marker: &str, events: &mut Vec<HarmonyEvent>) {
        let state = std::mem::replace(&mut self.state, State::Between);
        self.state = match (marker, state) {
            (START, State::Content(_)) => {
                events.push(HarmonyEvent::MessageEnd);
                State::Header(HeaderText::default(), Section::Role)
            }
            (START, _) => State::Header(HeaderText::default(), Section::Role),
            (CHANNEL, State::Content(previous)) => {
                events.push(HarmonyEvent::MessageEnd);
                let mut header = HeaderText::default();
                header.push(Section::Role, &previous.role);
                header.channel = Some(String::new());
                State::Header(header, Section::Channel)
            }
            (CHANNEL, State::Header(mut header, _)) => {
                header.channel = Some(String::new());
                header.raw.push_str(CHANNEL);
                State::Header(header, Section::Channel)
            }
            (CHANNEL, State::Between) => {
                let header = HeaderText { channel: Some(String::new()), ..HeaderText::default() };
                State::Header(header, Section::Channel)
            }
            (CONSTRAIN, State::Header(mut header, _)) => {
                header.constrain = Some(String::new());
                header.raw.push_str(CONSTRAIN);
                State::Header(header, Section::Constrain)
            }
            (MESSAGE, State::Header(header, _)) => open(header.finish("assistant"), events),
            (MESSAGE, State::Between) => open(HeaderText::default().finish("assistant"), events),
            (END, State::Content(_)) => {
                events.push(HarmonyEvent::MessageEnd);
                State::Between
            }
            (RETURN | CALL, state) => {
                if let State::Content(_) = state {
                    events.push(HarmonyEvent::MessageEnd);
                }
                let end = if marker == RETURN { TurnEnd::Return } else { TurnEnd::Call };
                self.ended = Some(end);
                events.push(HarmonyEvent::TurnEnd(end));
                State::Between
            }
            // Markers that mean nothing here are content inside a message,
            // and dropped elsewhere.
            (_, State::Content(header)) => {
                self.state = State::Content(header);
                self.text(marker, events);
                return;
            }
            (END, State::Header(..)) => State::Between,
            (_, state) => state,
        };
    }
}

fn open(header: MessageHeader, events: &mut Vec<HarmonyEvent>) -> State {
    events.push(HarmonyEvent::MessageStart(header.clone()));
    State::Content(header)
}

/// A tool call: a message addressed to a recipient.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    /// E.g. `functions.get_weather`, `browser.search`, `python`.
    pub recipient: String,
    pub channel: Channel,
    pub content_type: Option<String>,
    /// The message content, e.g. the JSON arguments.
    pub arguments: String,
}

/// A whole reply sorted by purpose.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HarmonyReply {
    /// The `analysis` messages (chain of thought), one per line.
    pub analysis: String,
    /// `commentary` messages without a recipient (preambles for the user).
    pub commentary: String,
    /// The `final` messages, and those with no or an unknown channel.
    pub answer: String,
    pub tool_calls: Vec<ToolCall>,
    pub turn_end: Option<TurnEnd>,
}

impl HarmonyReply {
    /// Parses a complete reply (as text, special tokens included).
    pub fn parse(text: &str) -> HarmonyReply {
        let mut parser = HarmonyParser::new();
        let mut events = parser.feed(text);
        events.extend(parser.finish());
        let mut reply = HarmonyReply { turn_end: parser.turn_end(), ..HarmonyReply::default() };
        let mut current: Option<MessageHeader> = None;
        let mut content = String::new();
        for event in events {
            match event {
                HarmonyEvent::MessageStart(header) => {
                    reply.close(current.take(), &mut content);
                    current = Some(header);
                }
                HarmonyEvent::Content(text) => content.push_str(&text),
                HarmonyEvent::MessageEnd => reply.close(current.take(), &mut content),
                HarmonyEvent::TurnEnd(_) => {}
            }
        }
        reply.close(current.take(), &mut content);
        reply
    }

    /// Files a finished message's content under its purpose.
    fn close(&mut self, header: Option<MessageHeader>, content: &mut String) {
        let Some(header) = header else { return };
        let text = std::mem::take(content);
        let append = |target: &mut String| {
            if !target.is_empty() {
                target.push('\n');
            }
            target.push_str(&text);
        };
        match (&header.recipient, &header.channel) {
            (Some(recipient), channel) => self.tool_calls.push(ToolCall {
                recipient: recipient.clone(),
                channel: channel.clone(),
                content_type: header.content_type.clone(),
                arguments: text,
            }),
            (None, Channel::Analysis) => append(&mut self.analysis),
            (None, Channel::Commentary) => append(&mut self.commentary),
            (None, _) => append(&mut self.answer),
        }
    }
}

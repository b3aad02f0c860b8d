//! The harmony parser on hand-written gpt-oss transcripts, whole and in
//! pieces that split markers anywhere.

use ts_engine::chat::harmony::{Channel, HarmonyEvent, HarmonyParser, HarmonyReply, MessageHeader, ToolCall, TurnEnd};

/// Events for a reply fed in `pieces`, with adjacent content merged so that
/// different splits compare equal.
fn events(pieces: &[&str]) -> Vec<HarmonyEvent> {
    let mut parser = HarmonyParser::new();
    let mut all: Vec<HarmonyEvent> = Vec::new();
    for piece in pieces {
        all.extend(parser.feed(piece));
    }
    all.extend(parser.finish());
    let mut merged: Vec<HarmonyEvent> = Vec::new();
    for event in all {
        match (merged.last_mut(), event) {
            (Some(HarmonyEvent::Content(last)), HarmonyEvent::Content(text)) => last.push_str(&text),
            (_, event) => merged.push(event),
        }
    }
    merged
}

/// The same reply fed whole, one character at a time, and in every two-way split.
fn events_every_way(text: &str) -> Vec<HarmonyEvent> {
    let whole = events(&[text]);
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(events(&chars), whole, "character by character");
    for (i, _) in text.char_indices().skip(1) {
        assert_eq!(events(&[&text[..i], &text[i..]]), whole, "split at byte {i}");
    }
    whole
}

fn header(channel: Channel) -> MessageHeader {
    MessageHeader { role: "assistant".into(), channel, recipient: None, content_type: None }
}

fn content(text: &str) -> HarmonyEvent {
    HarmonyEvent::Content(text.into())
}

#[test]
fn analysis_then_final() {
    let reply = "<|channel|>analysis<|message|>User asks: \"What is 2 + 2?\" Simple arithmetic.<|end|>\
                 <|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>";
    assert_eq!(
        events_every_way(reply),
        [
            HarmonyEvent::MessageStart(header(Channel::Analysis)),
            content("User asks: \"What is 2 + 2?\" Simple arithmetic."),
            HarmonyEvent::MessageEnd,
            HarmonyEvent::MessageStart(header(Channel::Final)),
            content("2 + 2 = 4."),
            HarmonyEvent::MessageEnd,
            HarmonyEvent::TurnEnd(TurnEnd::Return),
        ]
    );
}

#[test]
fn markers_split_across_pieces() {
    let pieces = [
        "<|chan",
        "nel|>analysis<|mes",
        "sage|>Think",
        "ing.<|e",
        "nd|><",
        "|start|>assistant<|channel|>final<|message|>Ans",
        "wer<|re",
        "turn|>",
    ];
    let mut parser = HarmonyParser::new();
    let mut seen = Vec::new();
    for piece in pieces {
        seen.push(parser.feed(piece));
    }
    assert_eq!(seen[0], []);
    assert_eq!(seen[1], []);
    assert_eq!(seen[2], [HarmonyEvent::MessageStart(header(Channel::Analysis)), content("Think")]);
    assert_eq!(seen[3], [content("ing.")], "the partial <|e is held back");
    assert_eq!(seen[4], [HarmonyEvent::MessageEnd]);
    assert_eq!(seen[5], [HarmonyEvent::MessageStart(header(Channel::Final)), content("Ans")]);
    assert_eq!(seen[6], [content("wer")]);
    assert_eq!(seen[7], [HarmonyEvent::MessageEnd, HarmonyEvent::TurnEnd(TurnEnd::Return)]);
    assert_eq!(parser.turn_end(), Some(TurnEnd::Return));
    assert_eq!(parser.finish(), []);
}

#[test]
fn tool_call_with_recipient_after_channel_and_constrain() {
    let reply = "<|channel|>analysis<|message|>Need to use function get_weather.<|end|>\
                 <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"location\":\"San Francisco\"}<|call|>";
    let got = events_every_way(reply);
    assert_eq!(
        got[3],
        HarmonyEvent::MessageStart(MessageHeader {
            role: "assistant".into(),
            channel: Channel::Commentary,
            recipient: Some("functions.get_weather".into()),
            content_type: Some("json".into()),
        })
    );
    assert_eq!(got[4], content("{\"location\":\"San Francisco\"}"));
    assert_eq!(got[5..], [HarmonyEvent::MessageEnd, HarmonyEvent::TurnEnd(TurnEnd::Call)]);
}

#[test]
fn recipient_in_role_section_and_content_type_without_constrain() {
    let reply = "<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{}<|call|>";
    assert_eq!(
        events_every_way(reply)[0],
        HarmonyEvent::MessageStart(MessageHeader {
            role: "assistant".into(),
            channel: Channel::Commentary,
            recipient: Some("functions.lookup".into()),
            content_type: Some("json".into()),
        })
    );
}

#[test]
fn preamble_and_tool_call_reply() {
    let reply = "<|channel|>analysis<|message|>{long chain of thought}<|end|>\
                 <|start|>assistant<|channel|>commentary<|message|>**Action plan**:\n1. Generate an HTML file<|end|>\
                 <|start|>assistant<|channel|>commentary to=functions.generate_file<|constrain|>json<|message|>{\"path\": \"index.html\"}<|call|>";
    assert_eq!(
        HarmonyReply::parse(reply),
        HarmonyReply {
            analysis: "{long chain of thought}".into(),
            commentary: "**Action plan**:\n1. Generate an HTML file".into(),
            answer: String::new(),
            tool_calls: vec![ToolCall {
                recipient: "functions.generate_file".into(),
                channel: Channel::Commentary,
                content_type: Some("json".into()),
                arguments: "{\"path\": \"index.html\"}".into(),
            }],
            turn_end: Some(TurnEnd::Call),
        }
    );
}

#[test]
fn reply_summary_separates_thinking_from_answer() {
    let reply = HarmonyReply::parse(
        "<|channel|>analysis<|message|>First thought.<|end|><|start|>assistant<|channel|>analysis<|message|>Second.<|end|>\
         <|start|>assistant<|channel|>final<|message|>The answer.<|return|>",
    );
    assert_eq!(reply.analysis, "First thought.\nSecond.");
    assert_eq!(reply.answer, "The answer.");
    assert!(reply.tool_calls.is_empty());
    assert_eq!(reply.turn_end, Some(TurnEnd::Return));
}

#[test]
fn text_that_only_looks_like_markers_stays_content() {
    let reply = "<|channel|>final<|message|>Use a < b, <|tag|>, <|endoftext|> and x<|y literally.<|return|>";
    assert_eq!(events_every_way(reply)[1], content("Use a < b, <|tag|>, <|endoftext|> and x<|y literally."));
    // <|message|> and <|constrain|> inside content are text too.
    let reply = "<|channel|>final<|message|>a<|message|>b<|constrain|>c<|end|>";
    assert_eq!(events_every_way(reply)[1], content("a<|message|>b<|constrain|>c"));
}

#[test]
fn stream_cut_off_releases_held_back_text() {
    assert_eq!(
        events(&["<|channel|>final<|message|>partial <|re"]),
        [HarmonyEvent::MessageStart(header(Channel::Final)), content("partial <|re")]
    );
    assert_eq!(
        events(&["<|channel|>final<|message|>ends with <"]),
        [HarmonyEvent::MessageStart(header(Channel::Final)), content("ends with <")]
    );
}

#[test]
fn reply_without_harmony_markers_comes_out_unspecified() {
    assert_eq!(
        events_every_way("Just plain text."),
        [HarmonyEvent::MessageStart(header(Channel::Unspecified)), content("Just plain text.")]
    );
    assert_eq!(HarmonyReply::parse("Just plain text.").answer, "Just plain text.");
}

#[test]
fn missing_end_before_next_header_is_implied() {
    let reply = "<|channel|>analysis<|message|>thinking<|start|>assistant<|channel|>final<|message|>done<|channel|>final<|message|>again<|return|>";
    assert_eq!(
        events_every_way(reply),
        [
            HarmonyEvent::MessageStart(header(Channel::Analysis)),
            content("thinking"),
            HarmonyEvent::MessageEnd,
            HarmonyEvent::MessageStart(header(Channel::Final)),
            content("done"),
            HarmonyEvent::MessageEnd,
            HarmonyEvent::MessageStart(header(Channel::Final)),
            content("again"),
            HarmonyEvent::MessageEnd,
            HarmonyEvent::TurnEnd(TurnEnd::Return),
        ]
    );
}

#[test]
fn text_between_messages_starts_a_header() {
    let reply = "<|channel|>analysis<|message|>a<|end|>\nassistant<|channel|>final<|message|>b<|return|>";
    let got = events_every_way(reply);
    assert_eq!(got[3], HarmonyEvent::MessageStart(header(Channel::Final)));
    assert_eq!(got[4], content("b"));
}

#[test]
fn other_channels_and_roles_are_reported() {
    let reply = "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{\"sunny\": true}<|end|>\
                 <|start|>assistant<|channel|>summary<|message|>x<|end|>";
    let got = events_every_way(reply);
    assert_eq!(
        got[0],
        HarmonyEvent::MessageStart(MessageHeader {
            role: "functions.get_weather".into(),
            channel: Channel::Commentary,
            recipient: Some("assistant".into()),
            content_type: None,
        })
    );
    assert_eq!(got[3], HarmonyEvent::MessageStart(header(Channel::Other("summary".into()))));
}

#[test]
fn current_header_tracks_the_open_message() {
    let mut parser = HarmonyParser::new();
    assert_eq!(parser.current_header(), None);
    parser.feed("<|channel|>final<|message|>Hi");
    assert_eq!(parser.current_header().map(|h| &h.channel), Some(&Channel::Final));
    parser.feed("<|return|>");
    assert_eq!(parser.current_header(), None);
}

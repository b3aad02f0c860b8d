//! Tool calls read back from replies in each syntax, whole and streamed in
//! pieces split at every character boundary; replies whose calls do not parse
//! stay text.

use serde_json::{Value, json};
use ts_engine::chat::FunctionCall;
use ts_engine::chat::reply::{ReplyParser, gather};
use ts_engine::chat::tool_calls::{ToolCallParser, ToolSyntax};

fn weather_tools() -> Vec<Value> {
    vec![json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}}}})]
}

fn call(name: &str, arguments: Value) -> FunctionCall {
    FunctionCall { name: name.into(), arguments }
}

/// Content, reasoning and calls of `text` fed through `make()` whole, one
/// character at a time and split in two at every character boundary: all
/// must agree.
fn parse_every_way(make: impl Fn() -> ReplyParser, text: &str) -> (String, String, Vec<FunctionCall>) {
    let run = |pieces: &[&str]| {
        let mut parser = make();
        let mut events = Vec::new();
        for piece in pieces {
            events.extend(parser.feed(piece));
        }
        events.extend(parser.finish());
        gather(events)
    };
    let whole = run(&[text]);
    assert_eq!(make().parse_all(text), whole, "parse_all");
    let chars: Vec<String> = text.chars().map(String::from).collect();
    assert_eq!(run(&chars.iter().map(String::as_str).collect::<Vec<_>>()), whole, "character by character");
    for (i, _) in text.char_indices().skip(1) {
        assert_eq!(run(&[&text[..i], &text[i..]]), whole, "split at byte {i}");
    }
    whole
}

fn hermes() -> ReplyParser {
    ReplyParser::plain(Some(ToolSyntax::Hermes), &weather_tools())
}

#[test]
fn syntax_follows_the_template() {
    assert_eq!(ToolSyntax::of_template("{{- '\\n<tool_call>\\n{\"name\": \"' }}"), Some(ToolSyntax::Hermes));
    assert_eq!(ToolSyntax::of_template("{{- '<|tool_call>call:' + name }}"), Some(ToolSyntax::Gemma4));
    assert_eq!(ToolSyntax::of_template("{{ messages }}"), None);
}

#[test]
fn hermes_call_alone() {
    let reply = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    let (content, reasoning, calls) = parse_every_way(hermes, reply);
    assert_eq!((content.as_str(), reasoning.as_str()), ("", ""));
    assert_eq!(calls, [call("get_weather", json!({"city": "Paris"}))]);
}

/// llama.cpp's Qwen3.5 parser broke on text before `<tool_call>` (its issue 20260).
#[test]
fn text_before_and_between_several_calls() {
    let reply = "Let me check both cities.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n\
                 and then\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Lyon\\\", \\\"days\\\": 2}\"}\n</tool_call>";
    let (content, _, calls) = parse_every_way(hermes, reply);
    assert_eq!(content, "Let me check both cities.\n\nand then\n");
    assert_eq!(
        calls,
        [call("get_weather", json!({"city": "Paris"})), call("get_weather", json!({"city": "Lyon", "days": 2}))]
    );
}

/// vLLM lost calls written inside `<think>` (vllm#39056).
#[test]
fn call_inside_think() {
    let reply = "<think>\nThe user wants weather.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n</think>\n\n";
    let (content, _, calls) = parse_every_way(hermes, reply);
    assert_eq!(content, "<think>\nThe user wants weather.\n\n</think>\n\n");
    assert_eq!(calls, [call("get_weather", json!({"city": "Oslo"}))]);
}

#[test]
fn end_marker_inside_arguments_does_not_end_the_call() {
    let reply = "<tool_call>{\"name\": \"echo\", \"arguments\": {\"text\": \"a </tool_call> b\"}}</tool_call>";
    let (content, _, calls) = parse_every_way(hermes, reply);
    assert_eq!(content, "");
    assert_eq!(calls, [call("echo", json!({"text": "a </tool_call> b"}))]);
}

#[test]
fn malformed_calls_stay_text() {
    for reply in [
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}\n</tool_call>",
        "<tool_call>\n{\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
        "<tool_call>\nget_weather(city=\"Paris\")\n</tool_call>",
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": [1, 2]}\n</tool_call>",
        "I would write <tool_call> here but will not.",
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par",
        "a < b and <tool_ca",
    ] {
        let (content, _, calls) = parse_every_way(hermes, reply);
        assert_eq!(content, reply);
        assert!(calls.is_empty(), "{reply}: {calls:?}");
    }
}

/// Qwen2.5-Coder 0.5B answers with the bare object, no tags.
#[test]
fn bare_calls_of_declared_tools_at_the_start() {
    let reply = "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}";
    let (content, _, calls) = parse_every_way(hermes, reply);
    assert_eq!(content, "");
    assert_eq!(calls, [call("get_weather", json!({"city": "Paris"}))]);
    let two = format!("\n{reply}\n{reply}\nDone.");
    let (content, _, calls) = parse_every_way(hermes, &two);
    assert_eq!((content.as_str(), calls.len()), ("\nDone.", 2));
    for text in [
        // Not a declared tool, text before it, not a call, unfinished.
        "{\"name\": \"get_time\", \"arguments\": {}}",
        "Here: {\"name\": \"get_weather\", \"arguments\": {}}",
        "{\"city\": \"Paris\"}",
        "{\"name\": \"get_weather\", \"arguments\": {\"city\": ",
    ] {
        let (content, _, calls) = parse_every_way(hermes, text);
        assert_eq!((content.as_str(), calls.len()), (text, 0));
    }
}

#[test]
fn unclosed_call_at_the_end_counts_when_it_parses() {
    let reply = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n";
    let (content, _, calls) = parse_every_way(hermes, reply);
    assert_eq!(content, "");
    assert_eq!(calls, [call("get_weather", json!({"city": "Rome"}))]);
}

#[test]
fn qwen3_coder_xml_calls_follow_declared_types() {
    let reply = "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n\
                 <parameter=days>\n3\n</parameter>\n<parameter=zip>\n10001\n</parameter>\n</function>\n</tool_call>";
    let (content, _, calls) = parse_every_way(hermes, reply);
    assert_eq!(content, "Checking.\n");
    assert_eq!(calls, [call("get_weather", json!({"city": "New York", "days": 3, "zip": "10001"}))]);
    let broken = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>";
    assert_eq!(parse_every_way(hermes, broken), (broken.to_owned(), String::new(), vec![]));
}

#[test]
fn glm_calls() {
    let reply = "<think></think>\nChecking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n\
                 <arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>";
    let (content, _, calls) = parse_every_way(hermes, reply);
    assert_eq!(content, "<think></think>\nChecking.\n");
    assert_eq!(calls, [call("get_weather", json!({"city": "Paris", "days": 2}))]);
    let broken = "<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>";
    assert_eq!(parse_every_way(hermes, broken).0, broken);
}

#[test]
fn gemma4_calls() {
    let gemma = || ReplyParser::plain(Some(ToolSyntax::Gemma4), &weather_tools());
    let reply = "Sure.<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>,days:2}<tool_call|>";
    let (content, _, calls) = parse_every_way(gemma, reply);
    assert_eq!(content, "Sure.");
    assert_eq!(calls, [call("get_weather", json!({"city": "Paris", "days": 2}))]);
    let broken = "<|tool_call>call:get_weather{city:<|\"|>Paris}<tool_call|>";
    assert_eq!(parse_every_way(gemma, broken).0, broken);
}

#[test]
fn without_tools_nothing_is_parsed() {
    let reply = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>";
    let (content, _, calls) = ReplyParser::plain(Some(ToolSyntax::Hermes), &[]).parse_all(reply);
    assert_eq!((content.as_str(), calls.len()), (reply, 0));
    let (content, _, calls) = ReplyParser::plain(None, &weather_tools()).parse_all(reply);
    assert_eq!((content.as_str(), calls.len()), (reply, 0));
}

#[test]
fn tool_call_parser_whole_reply() {
    let (content, calls) = ToolCallParser::parse(
        ToolSyntax::Hermes,
        &[],
        "x<tool_call>{\"name\": \"f\", \"parameters\": {\"a\": 1}}</tool_call>y",
    );
    assert_eq!(content, "xy");
    assert_eq!(calls, [call("f", json!({"a": 1}))]);
}

#[test]
fn harmony_calls_on_the_commentary_channel() {
    let harmony = || ReplyParser::harmony(true);
    // As gpt-oss writes it: reasoning, then a call with a JSON content type; the
    // turn's `<|call|>` is the end-of-generation token and never arrives as text.
    let reply = "<|channel|>analysis<|message|>Need weather.<|end|>\
                 <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}";
    let (content, reasoning, calls) = parse_every_way(harmony, reply);
    assert_eq!((content.as_str(), reasoning.as_str()), ("", "Need weather."));
    assert_eq!(calls, [call("get_weather", json!({"city": "Paris"}))]);
    // The recipient before the channel, and `<|call|>` shown.
    let reply = "<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.get_time<|channel|>commentary json\
                 <|message|>{}<|call|>";
    assert_eq!(parse_every_way(harmony, reply).2, [call("get_time", json!({}))]);
    // Arguments that are not a JSON object stay text.
    let reply = "<|channel|>commentary to=functions.get_weather<|message|>Paris please<|call|>";
    assert_eq!(parse_every_way(harmony, reply), ("Paris please".into(), String::new(), vec![]));
    // Without tools, the final channel is content and the rest reasoning.
    let reply = "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b<|return|>";
    assert_eq!(parse_every_way(|| ReplyParser::harmony(false), reply), ("b".into(), "a".into(), vec![]));
}

/// Every reference template that prints calls in a syntax we read: jinja2's rendering of
/// a conversation with two parallel calls (tests/data/chat/expected), from the user's
/// question on (the system part may hold example calls), reads back as those two calls:
/// the tool results and the turns around them do not read as calls. Templates that print
/// no earlier calls are passed over.
#[test]
fn calls_printed_by_real_templates_read_back() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat");
    let manifest: serde_json::Map<String, Value> =
        serde_json::from_slice(&std::fs::read(dir.join("templates.json")).unwrap()).unwrap();
    let (mut checked, mut failures) = (Vec::new(), Vec::new());
    for (name, entry) in &manifest {
        let source = std::fs::read_to_string(dir.join("templates").join(entry["file"].as_str().unwrap())).unwrap();
        let Some(syntax) = ToolSyntax::of_template(&source) else { continue };
        let expected: Value =
            serde_json::from_slice(&std::fs::read(dir.join("expected").join(format!("{name}.json"))).unwrap()).unwrap();
        let Some(text) = expected["cases"]["parallel-tool-calls"]["text"].as_str() else { continue };
        let from = text.rfind("Weather and time in Paris?").expect("the question");
        if !text[from..].contains("get_time") {
            // The template shows the format but prints no earlier calls (granite's tool-call tests).
            continue;
        }
        let (_, calls) = ToolCallParser::parse(syntax, &[], &text[from..]);
        if calls != [call("get_weather", json!({"city": "Paris"})), call("get_time", json!({"city": "Paris"}))] {
            failures.push(format!("{name} ({syntax:?}): {calls:?} in\n{}", &text[from..]));
        }
        checked.push(name.as_str());
    }
    eprintln!("{} templates: {}", checked.len(), checked.join(", "));
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    assert!(checked.len() >= 8, "only {checked:?}");
}

/// gpt-oss's template prints a call as a harmony message to `functions.NAME` (only an
/// assistant turn's first call: the parallel-calls rendering holds one): jinja2's rendering,
/// from the assistant's turn on, reads back as that call; tool results, addressed to the
/// assistant, do not.
#[test]
fn calls_printed_by_the_gpt_oss_template_read_back() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat/expected/openai-gpt-oss-120b.json");
    let expected: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    for (case, want) in [
        ("tool-call-round-trip", call("get_weather", json!({"city": "Paris", "unit": "celsius"}))),
        ("parallel-tool-calls", call("get_weather", json!({"city": "Paris"}))),
    ] {
        let text = expected["cases"][case]["text"].as_str().unwrap();
        let question = text.rfind("Paris?").unwrap();
        let reply = &text[question..];
        let reply = &reply[reply.find("<|start|>assistant").unwrap() + "<|start|>assistant".len()..];
        let (_, _, calls) = ReplyParser::harmony(true).parse_all(reply);
        assert_eq!(calls, [want], "{case}: {reply}");
    }
}

//! Constrained decoding on the three real models (byte-level BPE: SmolLM2 and
//! Qwen2.5; SentencePiece with byte tokens: Gemma 3): greedy replies under a
//! grammar's mask over the model's own logits are text of the grammar.

use serde_json::{Value, json};
use ts_engine::chat::ChatMessage;
use ts_engine::constraint::{ConstraintError, Grammar};
use ts_engine::decode::Decoding;
use ts_engine::sampler::SamplerConfig;
use ts_engine::session::{Engine, LoadOptions, StopReason};
use ts_model::ExpertPlacement;

const MODELS: [&str; 3] =
    ["smollm2-135m-instruct-q4_1.gguf", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "gemma-3-270m-q4_k_m.gguf"];

fn engine(file: &str) -> Engine {
    Engine::load(ts_testkit::real_model(file), &LoadOptions { threads: 2, experts: ExpertPlacement::Mapped }).unwrap()
}

/// The greedy reply to `question` (as a chat turn where the model has a template) under
/// `grammar`, at most `max_tokens`, and why it stopped.
fn reply(engine: &Engine, question: &str, grammar: &Grammar, max_tokens: usize) -> (String, StopReason) {
    let tokenizer = engine.tokenizer().unwrap();
    let text = match &engine.template {
        Some(t) => t.render(&[ChatMessage::user(question)], true).unwrap(),
        None => format!("{question}\n"),
    };
    let prompt = tokenizer.encode(&text, true, true).unwrap();
    let constraint = engine.grammars().unwrap().compile(grammar).unwrap();
    let mut seq = engine.new_sequence(prompt.len() + max_tokens + 1).unwrap();
    let mut logits = engine.prefill(&mut seq, &prompt, false).unwrap().pop().unwrap();
    let mut decoding = Decoding::new(tokenizer, &SamplerConfig::greedy(), &prompt, max_tokens, false, Vec::new())
        .unwrap()
        .constrained(Some(constraint));
    let mut out = String::new();
    let mut scratch = engine.scratch();
    loop {
        let next = decoding.next(&logits, seq.n_ctx - seq.n_past).unwrap();
        out.push_str(&next.text);
        if let Some(stop) = next.stop {
            return (out, stop);
        }
        let piece =
            ts_engine::decode::Piece { tokens: &[next.token.unwrap()], logits: ts_engine::decode::Logits::Last };
        logits = engine.step(&mut [&mut seq], &[piece], &mut scratch).unwrap().remove(0).remove(0);
    }
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3}
        },
        "required": ["name", "age", "role", "tags"],
        "additionalProperties": false
    })
}

/// What `person_schema` asks, checked on a parsed reply.
fn check_person(v: &Value) {
    let o = v.as_object().expect("an object");
    let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["age", "name", "role", "tags"], "{v}");
    assert!(o["name"].as_str().is_some_and(|s| s.chars().count() <= 20), "{v}");
    assert!(o["age"].as_u64().is_some_and(|a| a <= 120), "{v}");
    assert!(["admin", "user", "guest"].contains(&o["role"].as_str().unwrap()), "{v}");
    let tags = o["tags"].as_array().unwrap();
    assert!((1..=3).contains(&tags.len()), "{v}");
    assert!(tags.iter().all(|t| t.as_str().is_some_and(|s| s.chars().count() <= 10)), "{v}");
}

#[test]
fn schema_replies_parse_and_validate_on_every_vocabulary() {
    for file in MODELS {
        let engine = engine(file);
        let (text, stop) =
            reply(&engine, "Describe a user of a web site as JSON.", &Grammar::JsonSchema(person_schema()), 120);
        println!("{file}: {text}");
        assert_eq!(stop, StopReason::Stop, "{file}: the grammar completes before the token limit: {text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{file}: not JSON ({e}): {text}"));
        check_person(&v);

        let (text, stop) = reply(&engine, "Reply with a JSON object.", &Grammar::JsonObject, 60);
        if stop != StopReason::Length {
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{file}: not JSON ({e}): {text}"));
            assert!(v.is_object(), "{file}: {text}");
        } else {
            assert!(text.trim_start().starts_with('{'), "{file}: {text}");
        }
    }
}

#[test]
fn lark_literals_match_special_and_plain_tokens() {
    // Qwen2.5's <tool_call> is a user-defined token: the literal matches it (or its spelling).
    let engine = engine("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    let schema = json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                        "required": ["city"], "additionalProperties": false});
    let grammar = Grammar::Lark(format!("start: \"<tool_call>\\n\" %json{schema} \"\\n</tool_call>\""));
    let (text, stop) = reply(&engine, "What is the weather in Paris? Call a tool.", &grammar, 40);
    assert_eq!(stop, StopReason::Stop, "{text}");
    let body = text.strip_prefix("<tool_call>\n").and_then(|t| t.strip_suffix("\n</tool_call>")).expect(&text);
    let v: Value = serde_json::from_str(body).unwrap();
    assert!(v["city"].as_str().is_some_and(|c| !c.is_empty() && c.chars().count() <= 12), "{text}");
}

#[test]
fn schemas_llguidance_cannot_compile_are_refused_with_its_reason() {
    let engine = engine("smollm2-135m-instruct-q4_1.gguf");
    let grammars = engine.grammars().unwrap();
    for bad in [
        json!({"type": "object", "properties": {"a": {"type": "strin"}}}),
        json!({"type": "integer", "minimum": 5, "maximum": 1}),
        json!({"$ref": "#/$defs/missing"}),
    ] {
        match grammars.compile(&Grammar::JsonSchema(bad.clone())) {
            Err(ConstraintError::Compile(reason)) => {
                println!("{bad}: {reason}");
                assert!(!reason.is_empty(), "{bad}")
            }
            Err(e) => panic!("{bad}: {e}"),
            Ok(_) => panic!("{bad} compiled"),
        }
    }
    let undefined = grammars.compile(&Grammar::Lark("start: greeting".into()));
    assert!(matches!(&undefined, Err(ConstraintError::Compile(r)) if r.contains("greeting")), "{:?}", undefined.err());
}

#[test]
fn forced_tool_calls_are_calls_whose_arguments_fit_the_parameters() {
    use ts_engine::chat::reply::ReplyParser;
    use ts_engine::chat::tool_calls::{ToolSyntax, forced_calls_grammar};
    let engine = engine("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    let source = engine.template.as_ref().unwrap().source();
    let tools = vec![json!({"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": false}}})];
    let grammar = forced_calls_grammar(source, &tools, false).expect("Qwen2.5 calls in Hermes JSON");
    let (text, stop) = reply(&engine, "How warm is it in Oslo?", &Grammar::Lark(grammar), 60);
    assert_eq!(stop, StopReason::Stop, "{text}");
    let (content, _, calls) = ReplyParser::plain(ToolSyntax::of_template(source), &tools).parse_all(&text);
    assert!(content.trim().is_empty(), "{text}");
    assert_eq!(calls.len(), 1, "{text}");
    assert_eq!(calls[0].name, "get_weather");
    let args: Value = serde_json::from_str(&calls[0].arguments_json()).unwrap();
    assert!(args["city"].as_str().is_some_and(|c| !c.is_empty() && c.chars().count() <= 20), "{text}");
    assert!(["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap()), "{text}");

    // Gemma 3 shows no tools: no syntax to hold a reply to.
    assert!(forced_calls_grammar(engine_template("gemma-3-270m-q4_k_m.gguf").as_str(), &tools, true).is_none());
}

fn engine_template(file: &str) -> String {
    engine(file).template.map(|t| t.source().to_owned()).unwrap_or_default()
}

/// The tokenizer's own encoding of text the schema accepts passes the mask token by token,
/// and the grammar is complete at its end; prints the mask's time per token (Qwen2.5's
/// 151,936-token vocabulary).
#[test]
fn valid_text_passes_the_mask_token_by_token() {
    let engine = engine("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    let tokenizer = engine.tokenizer().unwrap();
    let text = r#"{"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "poetry"]}"#;
    let tokens = tokenizer.encode(text, false, false).unwrap();
    let mut constraint = engine.grammars().unwrap().compile(&Grammar::JsonSchema(person_schema())).unwrap();
    let mut logits = vec![0.0f32; tokenizer.vocab_size()];
    let start = std::time::Instant::now();
    for &t in &tokens {
        logits.fill(0.0);
        constraint.mask(&mut logits).unwrap();
        assert!(logits[t as usize].is_finite(), "{:?} masked", tokenizer.token_text(t));
        assert!(!constraint.is_done());
        constraint.commit(t).unwrap();
    }
    let per_token = start.elapsed() / tokens.len() as u32;
    println!("mask and commit: {per_token:?} per token over {} tokens", tokens.len());
    assert!(constraint.is_done(), "the object is complete");
    // A token that breaks the schema is masked: a digit where the name's string must start.
    let mut constraint = engine.grammars().unwrap().compile(&Grammar::JsonSchema(person_schema())).unwrap();
    for &t in &tokenizer.encode(r#"{"name": "#, false, false).unwrap() {
        constraint.mask(&mut logits).unwrap();
        constraint.commit(t).unwrap();
    }
    logits.fill(0.0);
    constraint.mask(&mut logits).unwrap();
    assert_eq!(logits[tokenizer.encode("7", false, false).unwrap()[0] as usize], f32::NEG_INFINITY);
    assert!(logits[tokenizer.encode("\"", false, false).unwrap()[0] as usize].is_finite());
}

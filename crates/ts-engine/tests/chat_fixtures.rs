//! The newer fixtures' chat templates (Qwen3.5's, Qwen3's and Gemma 4's, read
//! from the GGUF) render every conversation of their `chat.json` as transformers'
//! `apply_chat_template` did with the same tokenizer, thinking on and off,
//! and tokenize to the same ids (tools/fixtures wrote the expectations).
//! Where the text holds combining marks, transformers' tokenizer first
//! composes them (its NFC normalizer) and llama.cpp does not; our ids follow
//! llama.cpp's there (`cafe` + U+0301 is 5 pieces in both, 1 in transformers).

use serde::Deserialize;
use ts_engine::chat::{ChatMessage, ChatTemplate, TemplateKwargs};
use ts_tokenizer::Tokenizer;

#[derive(Deserialize)]
struct Expected {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    add_generation_prompt: bool,
    enable_thinking: bool,
    messages: Vec<ChatMessage>,
    text: String,
    ids: Vec<u32>,
    /// Tool declarations, passed as the template's `tools`.
    #[serde(default)]
    tools: Option<serde_json::Value>,
}

/// Renders and tokenizes every case of the fixtures' `chat.json` with tool
/// declarations (`with_tools`) or without; returns how many cases compared ids.
fn check_cases(with_tools: bool) -> usize {
    let mut ids_compared = 0;
    for family in ["qwen3_5_moe", "qwen3_next", "gemma4", "gemma4_moe"] {
        let dir = ts_testkit::fixtures_dir().join(family);
        let file = ts_gguf::GgufFile::open(dir.join("model-f32.gguf")).unwrap();
        let tokenizer = Tokenizer::from_metadata(file.metadata()).unwrap();
        let template = ChatTemplate::from_metadata(file.metadata(), &tokenizer).unwrap().expect("a chat template");
        let expected: Expected = serde_json::from_slice(&std::fs::read(dir.join("chat.json")).unwrap()).unwrap();
        assert!(expected.cases.len() >= 8, "{family}: {} cases", expected.cases.len());
        for case in expected.cases.iter().filter(|c| c.tools.is_some() == with_tools) {
            let mut kwargs = TemplateKwargs::new().set("enable_thinking", case.enable_thinking).unwrap();
            if let Some(tools) = &case.tools {
                kwargs = kwargs.set("tools", tools).unwrap();
            }
            let text = template.render_with(&case.messages, case.add_generation_prompt, &kwargs).unwrap();
            let what = format!("{family} {} (thinking {})", case.name, case.enable_thinking);
            assert_eq!(text, case.text, "{what}");
            if !text.chars().any(|c| ('\u{300}'..='\u{36f}').contains(&c)) {
                assert_eq!(tokenizer.encode(&text, false, true).unwrap(), case.ids, "{what}: ids");
                ids_compared += 1;
            }
        }
    }
    ids_compared
}

#[test]
fn fixture_templates_render_as_transformers() {
    let ids_compared = check_cases(false);
    assert!(ids_compared >= 24, "{ids_compared} cases compared ids");
}

/// Gemma 4's conversations with tool declarations and tool calls (8 cases).
#[test]
fn fixture_templates_with_tools_render_as_transformers() {
    let ids_compared = check_cases(true);
    assert!(ids_compared >= 8, "{ids_compared} cases compared ids");
}

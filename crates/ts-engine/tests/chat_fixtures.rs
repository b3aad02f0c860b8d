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
    /// Tool declarations; conversations with tools wait for tool-call
    /// support in the chat layer (issue 18) and are counted as skipped.
    #[serde(default)]
    tools: Option<serde_json::Value>,
}

#[test]
fn fixture_templates_render_as_transformers() {
    let mut ids_compared = 0;
    let mut skipped = 0;
    for family in ["qwen3_5_moe", "qwen3_next", "gemma4", "gemma4_moe"] {
        let dir = ts_testkit::fixtures_dir().join(family);
        let file = ts_gguf::GgufFile::open(dir.join("model-f32.gguf")).unwrap();
        let tokenizer = Tokenizer::from_metadata(file.metadata()).unwrap();
        let template = ChatTemplate::from_metadata(file.metadata(), &tokenizer).unwrap().expect("a chat template");
        let expected: Expected = serde_json::from_slice(&std::fs::read(dir.join("chat.json")).unwrap()).unwrap();
        assert!(expected.cases.len() >= 8, "{family}: {} cases", expected.cases.len());
        for case in &expected.cases {
            if case.tools.is_some() {
                skipped += 1;
                continue;
            }
            let kwargs = TemplateKwargs::new().set("enable_thinking", case.enable_thinking).unwrap();
            let text = template.render_with(&case.messages, case.add_generation_prompt, &kwargs).unwrap();
            let what = format!("{family} {} (thinking {})", case.name, case.enable_thinking);
            assert_eq!(text, case.text, "{what}");
            if !text.chars().any(|c| ('\u{300}'..='\u{36f}').contains(&c)) {
                assert_eq!(tokenizer.encode(&text, false, true).unwrap(), case.ids, "{what}: ids");
                ids_compared += 1;
            }
        }
    }
    if skipped > 0 {
        println!("skipped {skipped} cases with tool declarations (tool calls are not rendered yet)");
    }
    assert!(ids_compared >= 24, "{ids_compared} cases compared ids");
}

//! The chat-template API around the renderings: construction from GGUF
//! metadata, the ChatML fallback, errors, message content forms, extra
//! template variables.

use ts_engine::chat::{ChatError, ChatMessage, ChatTemplate, ContentPart, DateTime, TemplateKwargs};

fn conversation() -> Vec<ChatMessage> {
    vec![
        ChatMessage::system("Be brief."),
        ChatMessage::user("Hi"),
        ChatMessage::assistant("Hello."),
        ChatMessage::user("Bye"),
    ]
}

#[test]
fn chatml_fallback_renders_llama_cpp_chatml() {
    let template = ChatTemplate::chatml();
    assert_eq!(
        template.render(&conversation(), true).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(template.render(&[ChatMessage::user("x")], false).unwrap(), "<|im_start|>user\nx<|im_end|>\n");
}

#[test]
fn compile_errors_name_the_problem_and_line() {
    let err = ChatTemplate::new("{% for m in messages %}\n{{ m.content }\n{% endfor %}", "", "").unwrap_err();
    let ChatError::Compile(message) = &err else { panic!("expected a compile error, got {err:?}") };
    assert!(message.contains("syntax error"), "{message}");
    assert!(message.contains(":2"), "line number missing: {message}");

    let err = ChatTemplate::new("{% if x %}never closed", "", "").unwrap_err();
    assert!(matches!(err, ChatError::Compile(_)), "{err:?}");
}

#[test]
fn raise_exception_becomes_raised_error_with_its_message() {
    let template = ChatTemplate::new(
        "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}ok",
        "",
        "",
    )
    .unwrap();
    match template.render(&conversation(), true) {
        Err(ChatError::Raised(message)) => assert_eq!(message, "System role not supported"),
        other => panic!("expected Raised, got {other:?}"),
    }
    assert_eq!(template.render(&[ChatMessage::user("x")], true).unwrap(), "ok");
}

#[test]
fn engine_errors_are_render_errors() {
    let template = ChatTemplate::new("{{ messages[0].content.nope.deeper }}", "", "").unwrap();
    assert!(matches!(template.render(&[ChatMessage::user("x")], true), Err(ChatError::Render(_))));
    let template = ChatTemplate::new("{{ 1 // 0 }}", "", "").unwrap();
    assert!(matches!(template.render(&[], true), Err(ChatError::Render(_))));
}

#[test]
fn special_tokens_and_generation_prompt_reach_the_template() {
    let template =
        ChatTemplate::new("{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ tools }}", "<s>", "</s>")
            .unwrap();
    assert_eq!(template.render(&[], true).unwrap(), "<s>|</s>|True|None");
    assert_eq!(template.bos_token(), "<s>");
    assert_eq!(template.eos_token(), "</s>");
}

#[test]
fn kwargs_reach_the_template_and_override_defaults() {
    let template = ChatTemplate::new(
        "{{ reasoning_effort | default('medium') }} {{ enable_thinking }} {{ opts.depth if opts is defined }} {{ bos_token }}",
        "<s>",
        "",
    )
    .unwrap();
    let kwargs = TemplateKwargs::new()
        .set("reasoning_effort", "high")
        .unwrap()
        .set("enable_thinking", false)
        .unwrap()
        .set("opts", serde_json::json!({"depth": 3}))
        .unwrap()
        .set("bos_token", "[BOS]")
        .unwrap();
    assert_eq!(template.render_with(&[], false, &kwargs).unwrap(), "high False 3 [BOS]");
    assert_eq!(template.render(&[], false).unwrap(), "medium   <s>");

    let json = serde_json::json!({"enable_thinking": true});
    let kwargs = TemplateKwargs::from_json(json.as_object().unwrap()).unwrap();
    assert_eq!(template.render_with(&[], false, &kwargs).unwrap(), "medium True  <s>");
}

#[test]
fn strftime_now_uses_the_fixed_clock() {
    let mut template = ChatTemplate::new("{{ strftime_now('%d %b %Y') }}", "", "").unwrap();
    template.set_clock(DateTime::parse_iso("2024-12-25"));
    assert_eq!(template.render(&[], true).unwrap(), "25 Dec 2024");
    template.set_clock(None);
    let today = template.render(&[], true).unwrap();
    assert_eq!(today.len(), "25 Dec 2024".len(), "{today}");
}

#[test]
fn content_parts_join_with_newlines() {
    let parts =
        [ContentPart::text("one"), ContentPart { kind: "image_url".into(), text: None }, ContentPart::text("two")];
    assert_eq!(ChatMessage::from_parts("user", &parts), ChatMessage::user("one\ntwo"));

    let messages: Vec<ChatMessage> = serde_json::from_str(
        r#"[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null},
            {"role": "assistant"},
            {"role": "user", "content": "plain"}]"#,
    )
    .unwrap();
    assert_eq!(
        messages,
        [ChatMessage::user("a\nb"), ChatMessage::assistant(""), ChatMessage::assistant(""), ChatMessage::user("plain")]
    );
}

#[test]
fn templates_are_shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<ChatTemplate>();
}

mod real_models {
    use super::*;
    use ts_gguf::GgufFile;
    use ts_tokenizer::Tokenizer;

    /// A real model from tools/fetch-models.sh (tools/test.sh runs it): absent is a failure.
    fn load(file: &str) -> (GgufFile, Tokenizer) {
        let path = ts_testkit::models_dir().join(file);
        assert!(path.exists(), "{} is absent: run tools/fetch-models.sh", path.display());
        let gguf = GgufFile::open(&path).unwrap();
        let tokenizer = Tokenizer::from_metadata(gguf.metadata()).unwrap();
        (gguf, tokenizer)
    }

    #[test]
    fn smollm2_template_from_metadata() {
        let (gguf, tokenizer) = load("smollm2-135m-instruct-q4_1.gguf");
        let template = ChatTemplate::from_metadata(gguf.metadata(), &tokenizer).unwrap().expect("has a template");
        assert_eq!(template.bos_token(), "<|im_start|>");
        assert_eq!(template.eos_token(), "<|im_end|>");
        assert_eq!(
            template.render(&[ChatMessage::user("Hi")], true).unwrap(),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn qwen_coder_template_from_metadata() {
        let (gguf, tokenizer) = load("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
        let template = ChatTemplate::from_metadata(gguf.metadata(), &tokenizer).unwrap().expect("has a template");
        assert_eq!(template.bos_token(), "<|endoftext|>");
        assert_eq!(template.eos_token(), "<|im_end|>");
        let text = template.render(&[ChatMessage::user("Hi")], true).unwrap();
        assert!(text.starts_with("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud."), "{text}");
        assert!(text.ends_with("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"), "{text}");
    }

    #[test]
    fn gemma3_base_model_has_no_template() {
        let (gguf, tokenizer) = load("gemma-3-270m-q4_k_m.gguf");
        assert!(ChatTemplate::from_metadata(gguf.metadata(), &tokenizer).unwrap().is_none());
    }
}

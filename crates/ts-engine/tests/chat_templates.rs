//! Every committed chat template rendered on every committed conversation,
//! compared byte for byte with Python jinja2 set up as transformers sets it
//! up (`tools/chat-reference/gen.py` wrote the expected files).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use ts_engine::chat::{ChatError, ChatMessage, ChatTemplate, DateTime, TemplateKwargs};

/// Templates whose renderings are known to differ, and why.
const KNOWN_DIFFERENCES: &[(&str, &str)] = &[];

#[derive(Deserialize)]
struct Conversations {
    now: String,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    add_generation_prompt: bool,
    messages: Vec<ChatMessage>,
    #[serde(default)]
    kwargs: serde_json::Map<String, serde_json::Value>,
}

#[derive(Deserialize)]
struct TemplateEntry {
    file: String,
    bos_token: String,
    eos_token: String,
}

#[derive(Deserialize)]
struct Expected {
    cases: BTreeMap<String, Outcome>,
}

#[derive(Deserialize)]
struct Outcome {
    text: Option<String>,
    error: Option<String>,
    #[serde(default)]
    raised_by_template: bool,
}

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat")
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> T {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Where a rendering first differs, for the failure report.
fn first_difference(expected: &str, actual: &str) -> String {
    let at = expected.bytes().zip(actual.bytes()).take_while(|(a, b)| a == b).count();
    let context = |s: &str| {
        let mut start = at.saturating_sub(40).min(s.len());
        while !s.is_char_boundary(start) {
            start -= 1;
        }
        let mut end = (at + 40).min(s.len());
        while !s.is_char_boundary(end) {
            end += 1;
        }
        format!("{:?}", &s[start..end])
    };
    format!("byte {at}: expected …{}… got …{}…", context(expected), context(actual))
}

/// One case's verdict: `None` when it agrees with jinja2.
fn check_case(template: &ChatTemplate, case: &Case, outcome: &Outcome) -> Option<String> {
    let kwargs = TemplateKwargs::from_json(&case.kwargs).expect("kwargs convert");
    let rendered = template.render_with(&case.messages, case.add_generation_prompt, &kwargs);
    match (rendered, outcome) {
        (Ok(actual), Outcome { text: Some(expected), .. }) => {
            (actual != *expected).then(|| first_difference(expected, &actual))
        }
        (Err(ChatError::Raised(message)), Outcome { error: Some(expected), raised_by_template: true, .. }) => {
            (message != *expected).then(|| format!("raised {message:?}, jinja2 raised {expected:?}"))
        }
        (Err(ChatError::Raised(message)), Outcome { error: Some(_), .. }) => {
            Some(format!("raised {message:?} where jinja2 failed otherwise"))
        }
        (Err(ChatError::Render(_)), Outcome { error: Some(_), raised_by_template: false, .. }) => None,
        (Err(e), Outcome { error: Some(expected), .. }) => Some(format!("failed with {e}, jinja2: {expected}")),
        (Err(e), _) => Some(format!("failed with {e}")),
        (Ok(_), Outcome { error: Some(expected), .. }) => Some(format!("rendered, but jinja2 failed: {expected}")),
        (Ok(_), _) => Some("expected file has neither text nor error".into()),
    }
}

#[test]
fn templates_match_jinja2() {
    let dir = data_dir();
    let conversations: Conversations = read_json(&dir.join("conversations.json"));
    let now = DateTime::parse_iso(&conversations.now).expect("conversations.json has a valid `now`");
    let manifest: BTreeMap<String, TemplateEntry> = read_json(&dir.join("templates.json"));
    assert!(manifest.len() >= 30, "only {} templates in templates.json", manifest.len());

    let mut failures = Vec::new();
    let mut known = Vec::new();
    let mut cases_checked = 0;
    for (name, entry) in &manifest {
        let source = std::fs::read_to_string(dir.join("templates").join(&entry.file)).expect("template file");
        let expected: Expected = read_json(&dir.join("expected").join(format!("{name}.json")));
        let mut problems = Vec::new();
        match ChatTemplate::new(&source, &entry.bos_token, &entry.eos_token) {
            Err(e) => problems.push(format!("does not compile: {e}")),
            Ok(mut template) => {
                template.set_clock(Some(now));
                for case in &conversations.cases {
                    let outcome = &expected.cases[&case.name];
                    cases_checked += 1;
                    if let Some(problem) = check_case(&template, case, outcome) {
                        problems.push(format!("{}: {problem}", case.name));
                    }
                }
            }
        }
        let known_reason = KNOWN_DIFFERENCES.iter().find(|(n, _)| n == name).map(|(_, why)| *why);
        match (problems.is_empty(), known_reason) {
            (true, Some(_)) => failures.push(format!("{name}: listed as differing but now matches")),
            (true, None) => {}
            (false, Some(why)) => known.push(format!("{name}: {why}")),
            (false, None) => failures.push(format!("{name}:\n    {}", problems.join("\n    "))),
        }
    }
    eprintln!("{} templates, {cases_checked} renderings checked against jinja2", manifest.len());
    for line in &known {
        eprintln!("known difference: {line}");
    }
    assert!(failures.is_empty(), "{} templates differ from jinja2:\n{}", failures.len(), failures.join("\n"));
}

//! Every committed chat template rendered on every committed conversation,
//! compared byte for byte with Python jinja2 set up as transformers sets it
//! up (`tools/chat-reference/gen.py` wrote the expected files).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use ts_engine::chat::{ChatError, ChatMessage, ChatTemplate, DateTime, TemplateKwargs};

/// Renderings known to differ (template, its cases, why); every other case of
/// those templates is still compared.
const KNOWN_DIFFERENCES: &[(&str, &[&str], &str)] = &[
    (
        "llama-cpp-deepseek-r1",
        TOOL_CASES,
        "`tools | map(attribute='function') | tojson` fails in jinja2 (map gives a generator, which \
         json.dumps refuses); minijinja's map gives a list, so the tools render (as in llama.cpp)",
    ),
    (
        "meetkai-functionary-medium-v3.1",
        TOOL_CASES,
        "`\"...\"|safe + t | tojson()`: jinja2's Markup HTML-escapes the plain tool JSON added to it \
         (&#34;); minijinja adds plain text, the JSON the model was trained on",
    ),
];

/// The cases of conversations.json that declare tools.
const TOOL_CASES: &[&str] = &["tools-declared", "tools-no-system", "tool-call-round-trip", "parallel-tool-calls"];

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
    /// Tool declarations, passed as the template's `tools`.
    #[serde(default)]
    tools: Option<serde_json::Value>,
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
    let mut kwargs = TemplateKwargs::from_json(&case.kwargs).expect("kwargs convert");
    if let Some(tools) = &case.tools {
        kwargs = kwargs.set("tools", tools).expect("tools convert");
    }
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
        let known_cases: &[&str] = KNOWN_DIFFERENCES.iter().find(|(n, ..)| n == name).map_or(&[], |(_, c, _)| c);
        let mut problems = Vec::new();
        let mut known_differing = Vec::new();
        match ChatTemplate::new(&source, &entry.bos_token, &entry.eos_token) {
            Err(e) => problems.push(format!("does not compile: {e}")),
            Ok(mut template) => {
                template.set_clock(Some(now));
                for case in &conversations.cases {
                    let outcome = &expected.cases[&case.name];
                    cases_checked += 1;
                    let problem = check_case(&template, case, outcome);
                    match (problem, known_cases.contains(&case.name.as_str())) {
                        (Some(_), true) => known_differing.push(case.name.clone()),
                        (None, true) => problems.push(format!("{}: listed as differing but now matches", case.name)),
                        (Some(problem), false) => problems.push(format!("{}: {problem}", case.name)),
                        (None, false) => {}
                    }
                }
            }
        }
        if let Some((.., why)) = KNOWN_DIFFERENCES.iter().find(|(n, ..)| n == name) {
            known.push(format!("{name} ({}): {why}", known_differing.join(", ")));
        }
        if !problems.is_empty() {
            failures.push(format!("{name}:\n    {}", problems.join("\n    ")));
        }
    }
    eprintln!("{} templates, {cases_checked} renderings checked against jinja2", manifest.len());
    for line in &known {
        eprintln!("known difference: {line}");
    }
    assert!(failures.is_empty(), "{} templates differ from jinja2:\n{}", failures.len(), failures.join("\n"));
}

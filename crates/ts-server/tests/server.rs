//! The server end to end over real sockets with a real model (SmolLM2 from
//! tools/fetch-models.sh): the endpoints, batched decoding against one request
//! at a time, stop sequences, seeds, hostile requests, and a client that
//! vanishes mid-stream. The official `openai` Python client is driven by
//! tools/server-test/openai_e2e.py (test `openai_python_client`), its tool calls by
//! openai_tools_e2e.py and its structured output by openai_json_schema_e2e.py (on Qwen2.5-Coder);
//! the chat page at `/` is driven in headless Chromium by chat_page_browser.py.

use serde_json::{Value, json};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;
use ts_engine::chat::tool_calls::{ToolCallParser, ToolSyntax};
use ts_engine::chat::{ChatMessage, TemplateKwargs};
use ts_engine::session::{Engine, LoadOptions};
use ts_engine::speculative::{DEFAULT_P_MIN, SpecOptions};
use ts_model::ExpertPlacement;
use ts_server::{Running, ServeOptions};

const MODEL: &str = "smollm2-135m-instruct-q4_1.gguf";
const ID: &str = "smollm2";

/// The real model from tools/fetch-models.sh (tools/test.sh runs it): absent is a failure.
fn model() -> std::path::PathBuf {
    let path = ts_testkit::models_dir().join(MODEL);
    assert!(path.exists(), "{} is absent: run tools/fetch-models.sh", path.display());
    path
}

fn start(slot_ctx: usize) -> Running {
    start_with(slot_ctx, false)
}

fn start_with(slot_ctx: usize, prompt_cache: bool) -> Running {
    start_model(model(), slot_ctx, prompt_cache, None, None)
}

/// A server over the model at `path` (4 slots), guessing when `spec` is given: with the draft
/// model at `draft`, else by prompt lookup.
fn start_model(
    path: std::path::PathBuf,
    slot_ctx: usize,
    prompt_cache: bool,
    spec: Option<SpecOptions>,
    draft: Option<std::path::PathBuf>,
) -> Running {
    let load = |p| Engine::load(p, &LoadOptions { threads: 2, experts: ExpertPlacement::Mapped }).unwrap();
    let opts = ServeOptions {
        model_id: ID.into(),
        parallel: 4,
        slot_ctx,
        max_body: 1 << 20,
        prompt_cache,
        spec,
        draft_p_min: DEFAULT_P_MIN,
        spec_mtp: false,
    };
    ts_server::spawn_with_draft(load(path), draft.map(load), opts, "127.0.0.1:0".parse().unwrap()).unwrap()
}

/// Status, headers and body of one HTTP/1.0 exchange (the server closes after it).
fn http(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.0\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, head.to_string(), body.to_string())
}

fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let (status, _, body) = http(addr, "POST", path, body.to_string().as_bytes());
    (status, serde_json::from_str(&body).unwrap_or(Value::Null))
}

fn chat(addr: SocketAddr, prompt: &str, extra: Value) -> Value {
    let mut req = json!({"model": ID, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24});
    for (k, v) in extra.as_object().unwrap() {
        req[k] = v.clone();
    }
    let (status, v) = post(addr, "/v1/chat/completions", &req);
    assert_eq!(status, 200, "{v}");
    v
}

fn cached_tokens(addr: SocketAddr) -> f64 {
    let (_, _, m) = http(addr, "GET", "/metrics", b"");
    m.lines().find_map(|l| l.strip_prefix("turbospark_prompt_tokens_cached_total ")).unwrap().parse().unwrap()
}

fn content(v: &Value) -> String {
    v["choices"][0]["message"]["content"].as_str().unwrap().to_string()
}

#[test]
fn endpoints_batching_stops_and_seeds() {
    let server = start(1024);
    let addr = server.addr;

    let (status, _, body) = http(addr, "GET", "/health", b"");
    assert_eq!((status, body.as_str()), (200, r#"{"status":"ok"}"#));
    let (status, _, body) = http(addr, "GET", "/v1/models", b"");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((status, v["data"][0]["id"].as_str()), (200, Some(ID)));

    // Greedy replies, one at a time, then all at once (decoded in shared steps): identical.
    let prompts = ["What is 2 + 2?", "Name a color.", "Say hello in French.", "Write a haiku about rain."];
    let alone: Vec<Value> = prompts.iter().map(|p| chat(addr, p, json!({"temperature": 0}))).collect();
    for v in &alone {
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(
            v["usage"]["completion_tokens"].as_u64().unwrap() + v["usage"]["prompt_tokens"].as_u64().unwrap(),
            v["usage"]["total_tokens"].as_u64().unwrap()
        );
        assert!(!content(v).is_empty());
    }
    let together: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| s.spawn(move || chat(addr, p, json!({"temperature": 0, "logprobs": true}))))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // The first token comes from each request's own prefill; later ones from shared steps, whose
    // kernels (weight panels for several rows) sum in another order than one row's, so a near-tie
    // may later go the other way (ts-model's test `batched_rows_match_single_rows` bounds the
    // logits): the first token of every reply must agree, and it starts the reply.
    for (a, b) in alone.iter().zip(&together) {
        let first = b["choices"][0]["logprobs"]["content"][0]["token"].as_str().unwrap();
        assert!(!first.is_empty() && content(a).starts_with(first), "{} / {}", content(a), content(b));
        assert!(content(b).starts_with(first));
        assert!(b["usage"]["completion_tokens"].as_u64().unwrap() > 0);
    }

    // Seeds: the same seed gives the same sample; some other seed gives another.
    let sample = |seed: u64| content(&chat(addr, "Tell me a story.", json!({"temperature": 1.0, "seed": seed})));
    let first = sample(42);
    assert_eq!(first, sample(42));
    assert!((1..6).any(|s| sample(s) != first), "five other seeds all gave the same text");

    // Stop sequences end the text before them, with finish_reason "stop".
    let req = json!({"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0});
    let (_, plain) = post(addr, "/v1/completions", &req);
    let text = plain["choices"][0]["text"].as_str().unwrap().to_string();
    let stop = text.split_whitespace().nth(1).expect("two words").to_string();
    let mut with_stop = req.clone();
    with_stop["stop"] = json!([stop.clone()]);
    let (_, cut) = post(addr, "/v1/completions", &with_stop);
    let cut_text = cut["choices"][0]["text"].as_str().unwrap();
    assert_eq!(cut["choices"][0]["finish_reason"], "stop");
    assert_eq!(cut_text, &text[..text.find(&stop).unwrap()], "stop {stop:?} in {text:?}");

    // Streaming: chunks in order, then [DONE]; their text equals the whole answer.
    let req = json!({"model": ID, "messages": [{"role": "user", "content": prompts[0]}], "max_tokens": 24,
                     "temperature": 0, "stream": true, "stream_options": {"include_usage": true}});
    let (status, head, body) = http(addr, "POST", "/v1/chat/completions", req.to_string().as_bytes());
    assert_eq!(status, 200);
    assert!(head.to_ascii_lowercase().contains("text/event-stream"), "{head}");
    let events: Vec<&str> = body.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String =
        chunks.iter().filter_map(|c| c["choices"].get(0)?["delta"]["content"].as_str()).collect::<Vec<_>>().concat();
    assert_eq!(streamed, content(&alone[0]));
    let finish = &alone[0]["choices"][0]["finish_reason"];
    assert!(chunks.iter().any(|c| c["choices"].get(0).is_some_and(|ch| &ch["finish_reason"] == finish)));
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], alone[0]["usage"]["completion_tokens"]);

    // n choices: one sequence each; whole, then streamed (chunks of both choices, one [DONE]).
    let three = chat(addr, prompts[1], json!({"n": 3, "temperature": 1.0, "seed": 7, "max_tokens": 8}));
    let choices = three["choices"].as_array().unwrap();
    assert_eq!(choices.iter().map(|c| c["index"].as_u64().unwrap()).collect::<Vec<_>>(), [0, 1, 2]);
    assert!(choices.iter().all(|c| !c["message"]["content"].as_str().unwrap().is_empty()));
    assert!(three["usage"]["completion_tokens"].as_u64().unwrap() >= 3);
    let req = json!({"model": ID, "messages": [{"role": "user", "content": prompts[1]}], "max_tokens": 8, "n": 2,
                     "stream": true, "stream_options": {"include_usage": true}});
    let (status, _, body) = http(addr, "POST", "/v1/chat/completions", req.to_string().as_bytes());
    assert_eq!(status, 200);
    let events: Vec<&str> = body.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).collect();
    assert_eq!(events.iter().filter(|e| **e == "[DONE]").count(), 1);
    assert_eq!(events.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    for index in 0..2 {
        let of = |c: &&Value| c["choices"].get(0).is_some_and(|ch| ch["index"] == index);
        assert_eq!(chunks.iter().filter(of).filter(|c| c["choices"][0]["finish_reason"].is_string()).count(), 1);
    }
    let streamed_usage = &chunks.last().unwrap()["usage"];
    assert!(streamed_usage["completion_tokens"].as_u64().unwrap() >= 2, "{streamed_usage}");

    let (_, _, metrics) = http(addr, "GET", "/metrics", b"");
    assert!(metrics.contains("turbospark_requests_total "), "{metrics}");
    let count = |name: &str| -> f64 {
        metrics.lines().find_map(|l| l.strip_prefix(&format!("turbospark_{name} "))).unwrap().parse().unwrap()
    };
    assert!(count("requests_done_total") >= 13.0);
    assert!(count("completion_tokens_total") > 100.0);
    assert_eq!(count("queue_depth"), 0.0);
    server.stop().unwrap();
}

#[test]
fn hostile_requests_get_clear_errors_and_the_server_keeps_serving() {
    let server = start(256);
    let addr = server.addr;
    let ok = json!({"model": ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
    let with = |k: &str, v: Value| {
        let mut r = ok.clone();
        r[k] = v;
        r.to_string().into_bytes()
    };
    let long_prompt = "word ".repeat(400);
    let cases: Vec<(&str, &str, &str, Vec<u8>, u16)> = vec![
        ("malformed JSON", "POST", "/v1/chat/completions", br#"{"messages": ["#.to_vec(), 400),
        ("not an object", "POST", "/v1/chat/completions", b"[1, 2, 3]".to_vec(), 400),
        ("not UTF-8", "POST", "/v1/chat/completions", vec![0xff, 0xfe, 0x00, 0x80], 400),
        ("empty body", "POST", "/v1/chat/completions", Vec::new(), 400),
        ("messages missing", "POST", "/v1/chat/completions", br#"{"max_tokens": 4}"#.to_vec(), 400),
        ("messages a string", "POST", "/v1/chat/completions", with("messages", json!("hi")), 400),
        ("messages empty", "POST", "/v1/chat/completions", with("messages", json!([])), 400),
        (
            "content a number",
            "POST",
            "/v1/chat/completions",
            with("messages", json!([{"role": "user", "content": 7}])),
            400,
        ),
        ("temperature a string", "POST", "/v1/chat/completions", with("temperature", json!("hot")), 400),
        ("temperature 5", "POST", "/v1/chat/completions", with("temperature", json!(5)), 400),
        ("max_tokens negative", "POST", "/v1/chat/completions", with("max_tokens", json!(-3)), 400),
        ("max_tokens over the context", "POST", "/v1/chat/completions", with("max_tokens", json!(1_000_000)), 400),
        ("n = 0", "POST", "/v1/chat/completions", with("n", json!(0)), 400),
        ("n = 17", "POST", "/v1/chat/completions", with("n", json!(17)), 400),
        ("unknown model", "POST", "/v1/chat/completions", with("model", json!("gpt-9")), 404),
        ("stop a number", "POST", "/v1/chat/completions", with("stop", json!(5)), 400),
        ("seed a string", "POST", "/v1/chat/completions", with("seed", json!("42")), 400),
        (
            "prompt over the context",
            "POST",
            "/v1/completions",
            json!({"prompt": long_prompt}).to_string().into_bytes(),
            400,
        ),
        (
            "prompt of two strings",
            "POST",
            "/v1/completions",
            json!({"prompt": ["a", "b"]}).to_string().into_bytes(),
            400,
        ),
        ("10 MB body", "POST", "/v1/chat/completions", vec![b' '; 10 << 20], 413),
        ("unknown endpoint", "GET", "/v1/engines", Vec::new(), 404),
        ("wrong method", "GET", "/v1/chat/completions", Vec::new(), 405),
    ];
    for (name, method, path, body, want) in &cases {
        let (status, _, reply) = http(addr, method, path, body);
        assert_eq!(status, *want, "{name}: {reply}");
        let v: Value = serde_json::from_str(&reply).unwrap_or_else(|_| panic!("{name}: not JSON: {reply}"));
        let msg = v["error"]["message"].as_str().unwrap_or_else(|| panic!("{name}: no error message: {v}"));
        assert!(!msg.is_empty() && v["error"]["type"].is_string(), "{name}: {v}");
        println!("{name:<28} {status} {msg}");
    }

    // Garbage that is not HTTP: the connection is dropped, nothing else happens.
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"\x16\x03\x01\x02\x00 not http at all\r\n\r\n").unwrap();
    let mut sink = Vec::new();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = s.read_to_end(&mut sink);

    // A client that vanishes mid-stream: its sequence is freed.
    // (Counting goes on for the whole budget, so the reply cannot end by itself first.)
    let req = json!({"prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 200, "temperature": 0, "stream": true});
    let mut s = TcpStream::connect(addr).unwrap();
    let body = req.to_string();
    write!(s, "POST /v1/completions HTTP/1.0\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut first = [0u8; 512];
    let n = s.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).contains("200"));
    drop(s);
    let mut last = String::new();
    let cancelled = (0..100).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        last = http(addr, "GET", "/metrics", b"").2;
        last.lines().any(|l| l == "turbospark_requests_cancelled_total 1")
            && last.lines().any(|l| l == "turbospark_slots_busy 0")
    });
    let shown: Vec<&str> = last.lines().filter(|l| l.starts_with("turbospark_")).collect();
    assert!(cancelled, "the vanished client's sequence was not freed:\n{}", shown.join("\n"));

    // Still serving, and correctly (greedy: a sampled reply to "hi" may end before 4 tokens).
    let (status, v) =
        post(addr, "/v1/chat/completions", &serde_json::from_slice(&with("temperature", json!(0))).unwrap());
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    let (_, _, m) = http(addr, "GET", "/metrics", b"");
    assert!(m.lines().any(|l| l == format!("turbospark_requests_rejected_total {}", cases.len() - 2)), "{m}");
    server.stop().unwrap();
}

/// Runs `tools/server-test/SCRIPT ARGS...` with the Python that `tools/server-test/setup.sh`
/// made (`TURBOSPARK_OPENAI_PYTHON`, set by `tools/test.sh`), printing its output; fails with
/// its output when it does.
fn run_client_script(script: &str, args: &[&std::ffi::OsStr]) {
    let python = std::env::var_os("TURBOSPARK_OPENAI_PYTHON")
        .expect("TURBOSPARK_OPENAI_PYTHON is unset: set it to what tools/server-test/setup.sh prints");
    let out = std::process::Command::new(python)
        .arg(ts_testkit::repo_root().join("tools/server-test").join(script))
        .args(args)
        .output()
        .unwrap();
    print!("{}", String::from_utf8_lossy(&out.stdout));
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
}

/// An openai client script against `server`'s `/v1` and model `ID`.
fn run_openai_script(script: &str, server: &Running) {
    let base = format!("http://{}/v1", server.addr);
    run_client_script(script, &[base.as_ref(), ID.as_ref()]);
}

/// The official `openai` Python client against the server (tools/server-test/openai_e2e.py):
/// chat whole and streamed, completions, stop sequences, seeds, usage, errors as the client's
/// exception types. `tools/test.sh` makes the environment and sets `TURBOSPARK_OPENAI_PYTHON`.
#[test]
fn openai_python_client() {
    let server = start(1024);
    run_openai_script("openai_e2e.py", &server);
    server.stop().unwrap();
}

/// A tool-call round trip through the official `openai` Python client on Qwen2.5-Coder
/// (tools/server-test/openai_tools_e2e.py): call, tool result, answer; whole and streamed.
#[test]
fn openai_python_client_tool_calls() {
    let server = start_model(ts_testkit::real_model(QWEN), 2048, false, None, None);
    run_openai_script("openai_tools_e2e.py", &server);
    server.stop().unwrap();
}

/// With --prompt-cache, a second chat turn reads only what the first did not leave in a slot.
#[test]
fn second_turn_reuses_the_cached_first_turn() {
    let server = start_with(1024, true);
    let addr = server.addr;
    let first_turn = chat(addr, "Name a fruit.", json!({"temperature": 0}));
    let reply = content(&first_turn);
    let req = json!({"model": ID, "max_tokens": 8, "temperature": 0, "messages": [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And a vegetable?"}]});
    let cached_before = cached_tokens(addr);
    let (status, second) = post(addr, "/v1/chat/completions", &req);
    assert_eq!(status, 200, "{second}");
    let reused = cached_tokens(addr) - cached_before;
    let first_prompt = first_turn["usage"]["prompt_tokens"].as_f64().unwrap();
    assert!(reused >= first_prompt - 1.0, "reused {reused} of the first turn's {first_prompt} prompt tokens");

    assert!(!content(&second).is_empty());
    server.stop().unwrap();
}

/// Random bodies made from a valid request by replacing, deleting or adding fields with values
/// of every JSON type: each gets a status below 500 with a JSON body, and the server answers a
/// plain request correctly afterwards.
#[test]
fn randomly_mangled_requests_never_break_the_server() {
    let server = start(48);
    let addr = server.addr;
    let mut rng = ts_testkit::Rng::new(2026);
    let values = |rng: &mut ts_testkit::Rng| -> Value {
        match rng.next_u64() % 12 {
            0 => Value::Null,
            1 => json!(true),
            2 => json!(-1),
            3 => json!(1e300),
            4 => json!(0.5),
            5 => json!("x".repeat((rng.next_u64() % 40) as usize)),
            6 => json!([]),
            7 => json!([1, "a", null]),
            8 => json!({}),
            9 => json!([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]),
            10 => json!([{"role": 5}]),
            _ => json!(u64::MAX),
        }
    };
    let fields = [
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "n",
        "stream",
        "stream_options",
        "logprobs",
        "top_logprobs",
        "echo",
        "logit_bias",
        "response_format",
        "tools",
        "presence_penalty",
        "frequency_penalty",
        "extra",
    ];
    let mut statuses = std::collections::BTreeMap::new();
    for i in 0..120u32 {
        let path = if i.is_multiple_of(3) { "/v1/completions" } else { "/v1/chat/completions" };
        let mut req = json!({"model": ID, "messages": [{"role": "user", "content": "hi"}], "prompt": "hi",
                             "max_tokens": 2});
        for _ in 0..1 + rng.next_u64() % 3 {
            let f = fields[(rng.next_u64() % fields.len() as u64) as usize];
            if rng.next_u64().is_multiple_of(4) {
                req.as_object_mut().unwrap().remove(f);
            } else {
                req[f] = values(&mut rng);
            }
        }
        let (status, head, body) = http(addr, "POST", path, req.to_string().as_bytes());
        assert!((200..500).contains(&status), "{req} -> {status}: {body}");
        if !head.to_ascii_lowercase().contains("text/event-stream") {
            let v: Value = serde_json::from_str(&body).unwrap_or_else(|_| panic!("{req}: not JSON: {body}"));
            assert!(status == 200 || v["error"]["message"].is_string(), "{req} -> {status}: {v}");
        }
        *statuses.entry(status).or_insert(0) += 1;
    }
    println!("statuses: {statuses:?}");
    let (status, v) = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    assert!(v["choices"][0]["text"].as_str().unwrap().starts_with(" Paris."), "{v}");
    server.stop().unwrap();
}

/// Log-probabilities of `/v1/completions` against llama.cpp's greedy runs of the
/// same model (tests/data/llama-cpp/greedy.json): the same tokens, and the gap
/// between the two most likely (a difference of log-probabilities is one of
/// logits) close to llama.cpp's, up to its first near-tie; then the shape of
/// chat's logprobs, logit_bias, echo, and the requests that must be refused.
#[test]
fn logprobs_match_llama_cpp_logit_bias_steers_and_bad_requests_are_refused() {
    let server = start(1024);
    let addr = server.addr;
    let tokenizer = ts_tokenizer::Tokenizer::from_gguf(model()).unwrap();
    let piece = |id: u64| String::from_utf8_lossy(&tokenizer.token_to_piece(id as u32, true).unwrap()).into_owned();
    let path = ts_testkit::repo_root().join("tests/data/llama-cpp/greedy.json");
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut checked = 0;
    for run in reference["runs"].as_array().unwrap().iter().filter(|r| r["model"] == MODEL) {
        let margins: Vec<f64> = run["margins"].as_array().unwrap().iter().map(|m| m.as_f64().unwrap()).collect();
        let steps = margins.iter().position(|&m| m < 0.5).unwrap_or(margins.len());
        if steps == 0 {
            continue;
        }
        let req = json!({"model": ID, "prompt": run["prompt"], "max_tokens": steps, "temperature": 0, "logprobs": 2});
        let (status, v) = post(addr, "/v1/completions", &req);
        assert_eq!(status, 200, "{v}");
        let lp = &v["choices"][0]["logprobs"];
        let tokens = lp["tokens"].as_array().unwrap();
        for (i, token) in tokens.iter().enumerate().take(steps) {
            assert_eq!(token.as_str().unwrap(), piece(run["generated"][i].as_u64().unwrap()), "step {i}: {v}");
            let top: Vec<f64> =
                lp["top_logprobs"][i].as_object().unwrap().values().map(|x| x.as_f64().unwrap()).collect();
            assert_eq!(top.len(), 2, "{v}");
            let (hi, lo) = (top[0].max(top[1]), top[0].min(top[1]));
            assert!((lp["token_logprobs"][i].as_f64().unwrap() - hi).abs() < 1e-6, "greedy takes the top token");
            assert!(hi <= 0.0 && hi.exp() + lo.exp() <= 1.0 + 1e-5);
            // 8-bit activations on both sides, in other summation orders: the logits of the two
            // engines differ by up to ~0.3 here (hence the greedy tests' near-tie bound of 0.5).
            assert!((hi - lo - margins[i]).abs() < 0.35, "step {i}: gap {} vs llama.cpp {}", hi - lo, margins[i]);
            checked += 1;
        }
        let offsets: Vec<u64> = lp["text_offset"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
        assert_eq!(offsets[0], 0);
        assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
    }
    assert!(checked >= 5, "only {checked} steps compared");

    // Scoring a prompt (echo + logprobs, max_tokens 0, the prompt as token ids): llama.cpp's
    // prompt and its greedy continuation; each continuation token is the most likely at its
    // position, with the same gap to the second, up to the first near-tie.
    let mut scored = 0;
    for run in reference["runs"].as_array().unwrap().iter().filter(|r| r["model"] == MODEL) {
        let margins: Vec<f64> = run["margins"].as_array().unwrap().iter().map(|m| m.as_f64().unwrap()).collect();
        let steps = margins.iter().position(|&m| m < 0.5).unwrap_or(margins.len());
        let prompt: Vec<u64> = run["prompt_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
        let generated: Vec<u64> = run["generated"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
        let ids: Vec<u64> = prompt.iter().chain(&generated[..steps]).copied().collect();
        let req = json!({"prompt": ids, "max_tokens": 0, "echo": true, "logprobs": 2, "temperature": 0});
        let (status, v) = post(addr, "/v1/completions", &req);
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 0, "{v}");
        let lp = &v["choices"][0]["logprobs"];
        assert_eq!(lp["tokens"].as_array().unwrap().len(), ids.len(), "{v}");
        assert!(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null());
        for (j, &want) in generated[..steps].iter().enumerate() {
            let i = prompt.len() + j;
            assert_eq!(lp["tokens"][i].as_str().unwrap(), piece(want));
            let top: Vec<(String, f64)> = lp["top_logprobs"][i]
                .as_object()
                .unwrap()
                .iter()
                .map(|(t, x)| (t.clone(), x.as_f64().unwrap()))
                .collect();
            let best = top.iter().max_by(|a, b| a.1.total_cmp(&b.1)).unwrap();
            assert_eq!(best.0, piece(want), "position {i}: {top:?}");
            assert!((lp["token_logprobs"][i].as_f64().unwrap() - best.1).abs() < 1e-6);
            let gap = best.1 - top.iter().map(|t| t.1).filter(|&x| x < best.1).fold(f64::NEG_INFINITY, f64::max);
            assert!((gap - margins[j]).abs() < 0.35, "position {i}: gap {gap} vs llama.cpp {}", margins[j]);
            scored += 1;
        }
    }
    assert!(scored >= 5, "only {scored} prompt positions compared");

    // A scored string prompt: each token's text stands at its offset in the echoed text (a BOS
    // the tokenizer added stands for none); the chosen token heads its alternatives; n choices
    // share one scoring of the prompt.
    let req = json!({"prompt": "The capital of France is", "max_tokens": 3, "echo": true, "logprobs": 1,
                     "temperature": 0, "n": 2});
    let (status, v) = post(addr, "/v1/completions", &req);
    assert_eq!(status, 200, "{v}");
    let text: Vec<char> = v["choices"][0]["text"].as_str().unwrap().chars().collect();
    let lp = &v["choices"][0]["logprobs"];
    for (i, (token, offset)) in
        lp["tokens"].as_array().unwrap().iter().zip(lp["text_offset"].as_array().unwrap()).enumerate()
    {
        let (token, offset) = (token.as_str().unwrap(), offset.as_u64().unwrap() as usize);
        let at: String = text[offset.min(text.len())..].iter().collect();
        assert!(at.starts_with(token) || (i == 0 && offset == 0), "token {i} {token:?} at {offset} of {text:?}");
        if i > 0 {
            let first = lp["top_logprobs"][i].as_object().unwrap().iter().next().unwrap();
            assert!(first.1.as_f64().unwrap() >= lp["token_logprobs"][i].as_f64().unwrap() - 1e-6);
        }
    }
    // The prompt's entries are one scoring, shared; generated ones come from rows of one step,
    // summed in other orders, so only close.
    let n_prompt = v["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    let other = &v["choices"][1]["logprobs"]["token_logprobs"];
    assert_eq!(other.as_array().unwrap()[..n_prompt], lp["token_logprobs"].as_array().unwrap()[..n_prompt]);
    for (a, b) in other.as_array().unwrap().iter().zip(lp["token_logprobs"].as_array().unwrap()).skip(n_prompt) {
        assert!((a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-2, "{a} vs {b}");
    }

    // Chat: one entry per generated token, its text the reply's, with the alternatives asked for.
    let v = chat(addr, "Name a color.", json!({"temperature": 0, "logprobs": true, "top_logprobs": 3}));
    let entries = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(entries.len() as u64, v["usage"]["completion_tokens"].as_u64().unwrap());
    let joined: String = entries.iter().map(|e| e["token"].as_str().unwrap()).collect();
    assert_eq!(joined, content(&v));
    for e in entries {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(top[0]["token"], e["token"], "greedy takes the top token");
        assert!(e["logprob"].as_f64().unwrap() <= 0.0 && e["bytes"].is_array());
    }
    let plain = chat(addr, "Name a color.", json!({"temperature": 0}));
    assert!(plain["choices"][0]["logprobs"].is_null());

    // logit_bias: +100 on a token makes greedy decoding take it; -100 on the greedy choice moves off it.
    let banana = tokenizer.encode(" banana", false, false).unwrap()[0];
    let req = |bias: Value| json!({"prompt": "My favourite fruit is", "max_tokens": 1, "temperature": 0, "logprobs": 0, "logit_bias": bias});
    let first = |v: &Value| v["choices"][0]["logprobs"]["tokens"][0].as_str().unwrap().to_string();
    let (_, plain) = post(addr, "/v1/completions", &req(json!({})));
    let (status, forced) = post(addr, "/v1/completions", &req(json!({banana.to_string(): 100})));
    assert_eq!(status, 200, "{forced}");
    assert_eq!(first(&forced), piece(banana as u64));
    let greedy = tokenizer.encode(&first(&plain), false, false).unwrap()[0];
    let (_, moved) = post(addr, "/v1/completions", &req(json!({greedy.to_string(): -100})));
    assert_ne!(first(&moved), first(&plain));

    // Echo prepends the prompt.
    let (status, v) =
        post(addr, "/v1/completions", &json!({"prompt": "One, two,", "max_tokens": 4, "temperature": 0, "echo": true}));
    assert_eq!(status, 200, "{v}");
    assert!(v["choices"][0]["text"].as_str().unwrap().starts_with("One, two,"));

    for (path, body, param) in [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}), "logprobs"),
        ("/v1/completions", json!({"prompt": "hi", "logprobs": 6}), "logprobs"),
        ("/v1/completions", json!({"prompt": "hi", "logprobs": true}), "logprobs"),
        ("/v1/completions", json!({"prompt": "hi", "logprobs": 1, "echo": true, "stream": true}), "stream"),
        ("/v1/completions", json!({"prompt": "hi", "max_tokens": 0}), "max_tokens"),
        ("/v1/completions", json!({"prompt": [1, 99999999]}), "prompt"),
        ("/v1/completions", json!({"prompt": "", "echo": true, "logprobs": 1, "max_tokens": 0}), "prompt"),
        ("/v1/completions", json!({"prompt": [""], "echo": true, "logprobs": 1, "max_tokens": 0}), "prompt"),
        ("/v1/completions", json!({"prompt": [1, -2]}), "prompt"),
        ("/v1/completions", json!({"prompt": "hi", "logit_bias": {"x": 1}}), "logit_bias"),
        ("/v1/completions", json!({"prompt": "hi", "logit_bias": {"5": 101}}), "logit_bias"),
        ("/v1/completions", json!({"prompt": "hi", "logit_bias": {"99999999": 1}}), "logit_bias"),
        ("/v1/completions", json!({"prompt": "hi", "logit_bias": [1]}), "logit_bias"),
        ("/v1/completions", json!({"prompt": "hi", "suffix": "end"}), "suffix"),
        ("/v1/completions", json!({"prompt": "hi", "best_of": 3}), "best_of"),
        ("/v1/completions", json!({"prompt": "hi", "min_p": 2}), "min_p"),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}),
            "tools[0]",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}),
            "temperature",
        ),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": 7}]}), "messages[0].content"),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}),
            "response_format.type",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "response_format": {"type": "json_schema",
                   "json_schema": {"name": "n", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}}),
            "response_format.json_schema.schema",
        ),
    ] {
        let (status, v) = post(addr, path, &body);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
}

/// `/tokenize` gives llama.cpp's ids for the reference prompts (tests/data/llama-cpp/greedy.json);
/// `/detokenize` gives the text back; `/v1/models` says the context per request.
#[test]
fn tokenize_and_detokenize_match_llama_cpp() {
    let server = start(1024);
    let addr = server.addr;
    let path = ts_testkit::repo_root().join("tests/data/llama-cpp/greedy.json");
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    for run in reference["runs"].as_array().unwrap().iter().filter(|r| r["model"] == MODEL) {
        let (status, v) = post(addr, "/tokenize", &json!({"content": run["prompt"]}));
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["tokens"], run["prompt_ids"], "{}", run["prompt"]);
        assert_eq!(v["count"].as_u64().unwrap() as usize, run["prompt_ids"].as_array().unwrap().len());
        let (_, plain) = post(addr, "/tokenize", &json!({"prompt": run["prompt"], "add_special_tokens": false}));
        let (status, back) = post(addr, "/detokenize", &json!({"tokens": plain["tokens"]}));
        assert_eq!(status, 200, "{back}");
        assert_eq!(back["content"], run["prompt"]);
    }
    let (_, pieces) = post(addr, "/tokenize", &json!({"content": "Hello world", "with_pieces": true}));
    let joined: String = pieces["tokens"].as_array().unwrap().iter().map(|t| t["piece"].as_str().unwrap()).collect();
    assert!(joined.ends_with("Hello world"), "{pieces}");
    for (path, body) in [
        ("/tokenize", json!({})),
        ("/tokenize", json!({"content": 5})),
        ("/tokenize", json!({"content": "x", "add_special": "yes"})),
        ("/detokenize", json!({"tokens": "1 2"})),
        ("/detokenize", json!({"tokens": [1, 99999999]})),
    ] {
        let (status, v) = post(addr, path, &body);
        assert_eq!(status, 400, "{body}: {v}");
        assert!(v["error"]["message"].is_string());
    }
    let (_, _, body) = http(addr, "GET", "/v1/models", b"");
    let models: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(models["data"][0]["max_model_len"], 1024, "the context of one request");
}

/// A model with recurrent layers (the qwen3_5_moe fixture, F32: its Gated DeltaNet
/// layers cannot rewind) behind a server with `--prompt-cache` when `prompt_cache`.
fn start_hybrid(prompt_cache: bool) -> (Running, Engine) {
    let path = ts_testkit::fixtures_dir().join("qwen3_5_moe/model-f32.gguf");
    let load = || Engine::load(&path, &LoadOptions { threads: 2, experts: ExpertPlacement::Mapped }).unwrap();
    let opts = ServeOptions {
        model_id: ID.into(),
        parallel: 3,
        slot_ctx: 512,
        max_body: 1 << 20,
        prompt_cache,
        spec: None,
        draft_p_min: DEFAULT_P_MIN,
        spec_mtp: false,
    };
    (ts_server::spawn(load(), opts, "127.0.0.1:0".parse().unwrap()).unwrap(), load())
}

fn metric(addr: SocketAddr, name: &str) -> f64 {
    let (_, _, m) = http(addr, "GET", "/metrics", b"");
    m.lines().find_map(|l| l.strip_prefix(&format!("turbospark_{name} "))).unwrap().parse().unwrap()
}

/// The second turn of a chat with a hybrid model reads only what the first did not
/// leave: the slot goes back to its snapshot of where the first conversation ended
/// (before the generation prompt, which the template renders differently once the
/// reply is in the history), and its logits equal those of reading everything.
#[test]
fn hybrid_second_turn_reads_only_the_new_tokens() {
    let ((cached, engine), (plain, _)) = (start_hybrid(true), start_hybrid(false));
    let first: Vec<Value> = vec![json!({"role": "user", "content": "Tell me about the sea."})];
    let turn = |addr, messages: &[Value]| {
        let req = json!({"model": ID, "messages": messages, "max_tokens": 6, "temperature": 0,
                         "logprobs": true, "top_logprobs": 3});
        let (status, v) = post(addr, "/v1/chat/completions", &req);
        assert_eq!(status, 200, "{v}");
        v
    };
    let one = turn(cached.addr, &first);
    let mut second = first.clone();
    second.push(json!({"role": "assistant", "content": content(&one)}));
    second.push(json!({"role": "user", "content": "And the mountains?"}));
    let (read_before, kept_before) =
        (metric(cached.addr, "prompt_tokens_total"), metric(cached.addr, "prompt_tokens_cached_total"));
    let two = turn(cached.addr, &second);
    let read = metric(cached.addr, "prompt_tokens_total") - read_before;
    let kept = metric(cached.addr, "prompt_tokens_cached_total") - kept_before;

    // Where the first conversation ends: its messages rendered without the generation prompt.
    let messages: Vec<ts_engine::chat::ChatMessage> = serde_json::from_value(json!(first)).unwrap();
    let text = engine.template.as_ref().unwrap().render(&messages, false).unwrap();
    let conversation = engine.tokenizer().unwrap().encode(&text, false, true).unwrap().len() as f64;
    let prompt = two["usage"]["prompt_tokens"].as_f64().unwrap();
    println!("second turn: {prompt} prompt tokens, {kept} kept from the first turn, {read} read");
    assert_eq!(kept, conversation, "the slot goes back to the end of the first conversation");
    assert_eq!(read, prompt - conversation, "only the new tokens are read");

    // The same turn on a server that reads everything: the same tokens and log-probabilities.
    let again = turn(plain.addr, &second);
    let entries = |v: &Value| v["choices"][0]["logprobs"]["content"].as_array().unwrap().clone();
    let (a, b) = (entries(&two), entries(&again));
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x["token"], y["token"], "{x} vs {y}");
        let (lx, ly) = (x["logprob"].as_f64().unwrap(), y["logprob"].as_f64().unwrap());
        assert!((lx - ly).abs() < 1e-3, "log-probability {lx} vs {ly}");
    }

    // n choices read the prompt once and copy the state: greedy choices equal the single reply.
    let req = json!({"model": ID, "messages": second, "max_tokens": 6, "temperature": 0, "n": 3});
    let (status, three) = post(plain.addr, "/v1/chat/completions", &req);
    assert_eq!(status, 200, "{three}");
    for c in three["choices"].as_array().unwrap() {
        assert_eq!(c["message"]["content"], again["choices"][0]["message"]["content"], "{three}");
    }
    cached.stop().unwrap();
    plain.stop().unwrap();
}

/// Guesses in the server (`--spec-ngram`, and `--draft-model` with SmolLM2 drafting for
/// itself, the only pair of one vocabulary here): greedy replies equal those of a server that
/// does not guess, alone and with two requests at once (a sequence guesses only while it is
/// the only one in the server), on SmolLM2 and on a model
/// with recurrent layers (whose rejected guesses are undone from a snapshot); the guesses are
/// counted, and a request can turn them off (`speculative.n_max: 0`).
#[test]
fn prompt_lookup_keeps_greedy_replies_and_counts_its_guesses() {
    let list = "apple, banana, cherry, date, elderberry, fig, grape, kiwi, lemon, mango";
    let prompts = [
        format!("Repeat this list exactly, twice: {list}. {list}."),
        format!("Copy the words below in the same order.\n{list}\n{list}"),
    ];
    let hybrid = ts_testkit::fixtures_dir().join("qwen3_5_moe/model-f32.gguf");
    let cases =
        [(model(), None, "smollm2"), (hybrid, None, "qwen3_5_moe"), (model(), Some(model()), "smollm2 drafting")];
    for (path, draft, name) in cases {
        let plain = start_model(path.clone(), 1024, false, None, None);
        // A draft as dear as its target never pays, so the adaptive length would not guess at
        // all: guesses of the fixed length, so that they run.
        let opts = SpecOptions { adapt: draft.is_none(), ..SpecOptions::default() };
        let guessing = start_model(path, 1024, false, Some(opts), draft);
        let ask = |addr, prompt: &str, extra: Value| {
            let mut extra_all = json!({"temperature": 0, "max_tokens": 40});
            for (k, v) in extra.as_object().unwrap() {
                extra_all[k] = v.clone();
            }
            content(&chat(addr, prompt, extra_all))
        };
        let want: Vec<String> = prompts.iter().map(|p| ask(plain.addr, p, json!({}))).collect();
        // One at a time, then both together (guesses of two sequences in one step).
        for (p, w) in prompts.iter().zip(&want) {
            assert_eq!(&ask(guessing.addr, p, json!({})), w, "{name}: alone");
        }
        // Together, the two sequences share steps. Steps that check guesses give each row its
        // one-row result, but a step without guesses where one sequence's prompt rows meet the
        // other's decode row multiplies them through weight panels (another order of sums), so
        // a near-tie may go the other way, as in `endpoints_batching_stops_and_seeds`: each
        // reply starts with the plain reply's first token, and guesses run.
        let together: Vec<Value> = std::thread::scope(|s| {
            let handles: Vec<_> = prompts
                .iter()
                .map(|p| {
                    s.spawn(move || {
                        chat(guessing.addr, p, json!({"temperature": 0, "max_tokens": 40, "logprobs": true}))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (v, w) in together.iter().zip(&want) {
            let first = v["choices"][0]["logprobs"]["content"][0]["token"].as_str().unwrap();
            assert!(!first.is_empty() && w.starts_with(first), "{name}: together, {} / {w}", content(v));
        }
        let (drafted, kept) =
            (metric(guessing.addr, "spec_drafted_total"), metric(guessing.addr, "spec_accepted_total"));
        println!("{name}: {kept} of {drafted} guesses kept; replies {want:?}");
        assert!(drafted > 0.0, "{name}: prompt lookup guessed nothing");
        assert_eq!(metric(plain.addr, "spec_drafted_total"), 0.0);
        // Turned off by the request: the same reply, no new guesses.
        assert_eq!(ask(guessing.addr, &prompts[0], json!({"speculative.n_max": 0})), want[0]);
        assert_eq!(metric(guessing.addr, "spec_drafted_total"), drafted);
        if name.starts_with("smollm2") {
            assert!(kept > 0.0, "{name}: a reply that copies its prompt, or its own draft, keeps some guesses");
        }
        plain.stop().unwrap();
        guessing.stop().unwrap();
    }
}

const QWEN: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

fn weather_tool() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                       "required": ["city"]}}})
}

/// The `tool_calls` of a streamed chat answer, put together from its `delta.tool_calls`
/// chunks; checks that each call's first chunk carries its id, type and name.
/// The one tool call a forced (`tool_choice` required, `parallel_tool_calls` false) request
/// gets, whole and streamed: each reply must finish with `tool_calls` and hold one call.
fn one_forced_call(addr: SocketAddr, request: &Value) -> [Value; 2] {
    let (status, v) = post(addr, "/v1/chat/completions", request);
    assert_eq!(status, 200, "{v}");
    println!("required: {}", v["choices"][0]["message"]);
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    let calls = v["choices"][0]["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{v}");
    let whole = calls[0].clone();
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let (status, _, body) = http(addr, "POST", "/v1/chat/completions", streamed.to_string().as_bytes());
    assert_eq!(status, 200, "{body}");
    let (calls, _, finish) = streamed_calls(&body);
    assert_eq!(finish.as_deref(), Some("tool_calls"), "{body}");
    assert_eq!(calls.len(), 1, "{body}");
    [whole, calls[0].clone()]
}

fn streamed_calls(body: &str) -> (Vec<Value>, String, Option<String>) {
    let (mut calls, mut content, mut finish): (Vec<Value>, String, Option<String>) = (Vec::new(), String::new(), None);
    for data in body.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|d| *d != "[DONE]") {
        let chunk: Value = serde_json::from_str(data).unwrap();
        let choice = &chunk["choices"][0];
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = Some(f.to_owned());
        }
        content += choice["delta"]["content"].as_str().unwrap_or("");
        for d in choice["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let index = d["index"].as_u64().unwrap() as usize;
            if index == calls.len() {
                assert!(d["id"].is_string() && d["type"] == "function" && d["function"]["name"].is_string(), "{d}");
                calls.push(json!({"id": d["id"], "type": "function",
                                  "function": {"name": d["function"]["name"], "arguments": ""}}));
            }
            let args = calls[index]["function"]["arguments"].as_str().unwrap().to_owned();
            calls[index]["function"]["arguments"] = json!(args + d["function"]["arguments"].as_str().unwrap_or(""));
        }
    }
    (calls, content, finish)
}

/// Tools on Qwen2.5-Coder (a Hermes `<tool_call>` template): the prompt is the model's
/// template rendered with the tools; the reply's calls are what the engine's parser reads
/// in the same prompt's raw greedy completion; streamed calls equal whole ones; a
/// conversation holding an assistant call and a tool result renders and is answered;
/// bad declarations are refused naming the field.
#[test]
fn tool_calls_on_qwen() {
    let path = ts_testkit::real_model(QWEN);
    let server = start_model(path.clone(), 2048, false, None, None);
    let addr = server.addr;
    let engine = Engine::load(&path, &LoadOptions { threads: 1, experts: ExpertPlacement::Mapped }).unwrap();
    let template = engine.template.as_ref().expect("Qwen2.5 has a template");
    let tokenizer = engine.tokenizer().unwrap();
    let tools = vec![weather_tool()];
    let kwargs = TemplateKwargs::new().set("tools", &tools).unwrap();
    let count = |messages: &[ChatMessage], kwargs: &TemplateKwargs| {
        let text = template.render_with(messages, true, kwargs).unwrap();
        (tokenizer.encode(&text, false, true).unwrap().len(), text)
    };

    let ask = "What is the weather in Paris? Use the get_weather tool.";
    let request = json!({"messages": [{"role": "user", "content": ask}], "tools": tools, "temperature": 0,
                         "max_tokens": 64});
    let (status, whole) = post(addr, "/v1/chat/completions", &request);
    assert_eq!(status, 200, "{whole}");
    let (with_tools, rendered) = count(&[ChatMessage::user(ask)], &kwargs);
    assert!(rendered.contains("# Tools") && rendered.contains("\"get_weather\""), "{rendered}");
    assert_eq!(whole["usage"]["prompt_tokens"], with_tools, "the prompt is the template rendered with the tools");
    assert!(with_tools > count(&[ChatMessage::user(ask)], &TemplateKwargs::new()).0);

    // The raw reply to the same prompt, read by the engine's parser, gives the same message.
    let (status, raw) = post(addr, "/v1/completions", &json!({"prompt": rendered, "temperature": 0, "max_tokens": 64}));
    assert_eq!(status, 200, "{raw}");
    let raw_text = raw["choices"][0]["text"].as_str().unwrap();
    println!("raw reply: {raw_text:?}");
    let (raw_content, calls) = ToolCallParser::parse(ToolSyntax::Hermes, &tools, raw_text);
    let message = &whole["choices"][0]["message"];
    let got: Vec<(String, Value)> = message["tool_calls"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|c| {
                    assert!(c["id"].as_str().unwrap().starts_with("call_") && c["type"] == "function", "{c}");
                    let args = serde_json::from_str(c["function"]["arguments"].as_str().unwrap()).unwrap();
                    (c["function"]["name"].as_str().unwrap().to_owned(), args)
                })
                .collect()
        })
        .unwrap_or_default();
    let want: Vec<(String, Value)> = calls.iter().map(|c| (c.name.clone(), c.arguments.clone())).collect();
    assert_eq!(got, want, "{whole}");
    // Greedy Qwen2.5-Coder 0.5B calls the tool here (as a bare JSON object, without tags).
    assert_eq!(want, [("get_weather".to_owned(), json!({"city": "Paris"}))]);
    assert_eq!(whole["choices"][0]["finish_reason"], "tool_calls");
    assert!(message["content"].is_null() && raw_content.trim().is_empty(), "{whole}");

    // Streamed: the same calls, as delta.tool_calls chunks.
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let (status, _, body) = http(addr, "POST", "/v1/chat/completions", streamed.to_string().as_bytes());
    assert_eq!(status, 200, "{body}");
    let (calls_streamed, content_streamed, finish) = streamed_calls(&body);
    assert_eq!(finish.as_deref(), Some("tool_calls"), "{body}");
    assert!(content_streamed.trim().is_empty(), "{body}");
    let strip_id = |c: &Value| (c["function"]["name"].clone(), c["function"]["arguments"].clone());
    let whole_calls: Vec<_> = message["tool_calls"].as_array().unwrap().iter().map(strip_id).collect();
    assert_eq!(calls_streamed.iter().map(strip_id).collect::<Vec<_>>(), whole_calls);

    // tool_choice none: no tools shown, nothing read.
    let mut none = request.clone();
    none["tool_choice"] = json!("none");
    let (status, v) = post(addr, "/v1/chat/completions", &none);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], count(&[ChatMessage::user(ask)], &TemplateKwargs::new()).0);
    assert!(v["choices"][0]["message"]["tool_calls"].is_null(), "{v}");

    // The next turn: the assistant's call (arguments as JSON text, as clients send them) and
    // the tool's result render as the template renders them, and the model answers.
    let call_id = message["tool_calls"][0]["id"].clone();
    let turn = json!([
        {"role": "user", "content": ask},
        {"role": "assistant", "content": null, "tool_calls": message["tool_calls"]},
        {"role": "tool", "tool_call_id": call_id, "content": "{\"temperature\": 21, \"sky\": \"clear\"}"},
    ]);
    let (status, answer) = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": turn, "tools": tools, "temperature": 0, "max_tokens": 48}),
    );
    assert_eq!(status, 200, "{answer}");
    let messages: Vec<ChatMessage> = serde_json::from_value(turn).unwrap();
    let (n, text) = count(&messages, &kwargs);
    assert!(
        text.contains("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>")
            && text.contains("<tool_response>\n{\"temperature\": 21"),
        "{text}"
    );
    assert_eq!(answer["usage"]["prompt_tokens"], n);
    let final_text = answer["choices"][0]["message"]["content"].as_str().unwrap_or("");
    println!("answer: {final_text:?}");
    assert!(!final_text.is_empty(), "{answer}");

    // Bad declarations and choices, refused naming the field.
    let bad_tool = |tool: Value| json!({"messages": [{"role": "user", "content": "hi"}], "tools": [tool]});
    for (body, param) in [
        (bad_tool(json!({"type": "function", "function": {"description": "no name"}})), "tools[0].function"),
        (
            bad_tool(json!({"type": "function", "function": {"name": "f", "parameters": [1]}})),
            "tools[0].function.parameters",
        ),
        (bad_tool(json!({"type": "function", "function": {"name": "bad name"}})), "tools[0].function.name"),
        (bad_tool(json!({"type": "retrieval", "function": {"name": "f"}})), "tools[0].type"),
        (bad_tool(json!("get_weather")), "tools[0]"),
        (
            json!({"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "sometimes"}),
            "tool_choice",
        ),
        (
            json!({"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                   "tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
            "tool_choice",
        ),
        (json!({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}), "tool_choice"),
        (
            json!({"messages": [{"role": "user", "content": "hi"}], "tools": tools, "parallel_tool_calls": 1}),
            "parallel_tool_calls",
        ),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {}}]}]}),
            "messages[0].tool_calls[0].function",
        ),
    ] {
        let (status, v) = post(addr, "/v1/chat/completions", &body);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
    server.stop().unwrap();

    // SmolLM2's template shows no tools: refused by name rather than ignored.
    let server = start(512);
    let (status, v) = post(
        server.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "tools": [weather_tool()]}),
    );
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "tools", "{v}");
    server.stop().unwrap();
}

/// A schema with required fields, an enum, a bounded integer and a bounded array.
fn order_schema() -> Value {
    json!({"type": "object", "properties": {
        "item": {"type": "string", "minLength": 1, "maxLength": 24},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
        "size": {"enum": ["small", "medium", "large"]},
        "extras": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2}},
        "required": ["item", "quantity", "size", "extras"], "additionalProperties": false})
}

/// `text` parsed, and checked against [`order_schema`] rule by rule.
fn check_order(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
    let o = v.as_object().unwrap_or_else(|| panic!("not an object: {text}"));
    let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["extras", "item", "quantity", "size"], "{text}");
    assert!(o["item"].as_str().is_some_and(|s| (1..=24).contains(&s.chars().count())), "{text}");
    assert!(o["quantity"].as_u64().is_some_and(|q| (1..=9).contains(&q)), "{text}");
    assert!(["small", "medium", "large"].contains(&o["size"].as_str().unwrap_or_default()), "{text}");
    let extras = o["extras"].as_array().unwrap();
    assert!(extras.len() <= 2 && extras.iter().all(|e| e.as_str().is_some_and(|s| s.chars().count() <= 12)), "{text}");
}

/// Structured output on Qwen2.5-Coder: `json_schema` replies (whole, streamed, on
/// /v1/completions) parse and keep the schema; `json_object` gives an object; `tool_choice`
/// required or named gives a call whose arguments keep the function's parameters; what
/// cannot be enforced is refused naming the field.
#[test]
fn structured_output_on_qwen() {
    let server = start_model(ts_testkit::real_model(QWEN), 2048, false, None, None);
    let addr = server.addr;
    let ask = |text: &str| json!([{"role": "user", "content": text}]);
    let format =
        json!({"type": "json_schema", "json_schema": {"name": "order", "schema": order_schema(), "strict": true}});
    let request = json!({"messages": ask("Order a coffee for me, as JSON."), "response_format": format,
                         "temperature": 0, "max_tokens": 80});
    let (status, v) = post(addr, "/v1/chat/completions", &request);
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    println!("json_schema: {text}");
    check_order(text);
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "the grammar ends the reply: {v}");

    // Streamed, and sampled: still the schema.
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    streamed["temperature"] = json!(1.0);
    streamed["seed"] = json!(7);
    let (status, _, body) = http(addr, "POST", "/v1/chat/completions", streamed.to_string().as_bytes());
    assert_eq!(status, 200, "{body}");
    let (calls, text, finish) = streamed_calls(&body);
    println!("streamed: {text}");
    assert!(calls.is_empty());
    check_order(&text);
    assert_eq!(finish.as_deref(), Some("stop"), "{body}");

    // /v1/completions takes response_format too.
    let (status, v) = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "A coffee order as JSON: ", "response_format": format, "temperature": 0, "max_tokens": 80}),
    );
    assert_eq!(status, 200, "{v}");
    check_order(v["choices"][0]["text"].as_str().unwrap());

    // json_object: an object, whatever is in it.
    let (status, v) = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": ask("Describe Paris in JSON."), "response_format": {"type": "json_object"},
                "temperature": 0, "max_tokens": 60}),
    );
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    if v["choices"][0]["finish_reason"] == "stop" {
        assert!(serde_json::from_str::<Value>(text).is_ok_and(|o| o.is_object()), "{text}");
    } else {
        assert!(text.starts_with('{'), "{text}");
    }

    // tool_choice required: a call, whose arguments keep the parameters (an enum the prompt does
    // not mention included), whole and streamed; a named function among two is the one called.
    let weather = json!({"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": false}}});
    let time = json!({"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}},
        "required": ["timezone"]}}});
    let check_call = |call: &Value, name: &str| {
        assert_eq!(call["function"]["name"], name, "{call}");
        let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        match name {
            "get_weather" => {
                assert!(args["city"].as_str().is_some_and(|c| !c.is_empty() && c.chars().count() <= 24), "{args}");
                assert!(["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap()), "{args}");
            }
            _ => {
                let tz = args["timezone"].as_str().unwrap();
                let (area, city) = tz.split_once('/').unwrap();
                for part in [area, city] {
                    let mut c = part.chars();
                    assert!(c.next().is_some_and(|f| f.is_ascii_uppercase()), "{tz}");
                    assert!(c.all(|c| c.is_ascii_lowercase()), "{tz}");
                }
            }
        }
    };
    let tools_request = json!({"messages": ask("Is it cold in Oslo right now?"), "tools": [weather, time],
                               "tool_choice": "required", "temperature": 0, "max_tokens": 60,
                               "parallel_tool_calls": false});
    let [whole, streamed] = one_forced_call(addr, &tools_request);
    let name = whole["function"]["name"].as_str().unwrap().to_owned();
    check_call(&whole, &name);
    check_call(&streamed, &name);

    let mut named = tools_request.clone();
    named["tool_choice"] = json!({"type": "function", "function": {"name": "get_time"}});
    let (status, v) = post(addr, "/v1/chat/completions", &named);
    assert_eq!(status, 200, "{v}");
    println!("named: {}", v["choices"][0]["message"]);
    check_call(&v["choices"][0]["message"]["tool_calls"][0], "get_time");

    // What cannot be enforced is refused by name.
    let bad_schema = json!({"type": "json_schema", "json_schema": {"name": "x", "schema":
        {"type": "integer", "minimum": 5, "maximum": 1}}});
    let mut bad_tool = tools_request.clone();
    bad_tool["tools"][1]["function"]["parameters"] = json!({"type": "object", "properties": {"t": {"type": "strin"}}});
    let mut both = tools_request.clone();
    both["response_format"] = json!({"type": "json_object"});
    for (body, param) in [
        (json!({"messages": ask("hi"), "response_format": bad_schema}), "response_format.json_schema.schema"),
        (json!({"messages": ask("hi"), "response_format": {"type": "json_schema"}}), "response_format.json_schema"),
        (bad_tool, "tools[1].function.parameters"),
        (both, "response_format"),
    ] {
        let (status, v) = post(addr, "/v1/chat/completions", &body);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
    server.stop().unwrap();
}

/// `tool_choice` required on a model whose template writes Qwen3.5's XML calls (the
/// qwen3_5_moe fixture: random weights, so only the grammar makes it call): a parsed call
/// whose arguments keep the declared parameters, whole and streamed; a named function is the
/// one called.
#[test]
fn forced_tool_calls_in_xml_syntax() {
    let server = start_model(ts_testkit::fixtures_dir().join("qwen3_5_moe/model-f32.gguf"), 2048, false, None, None);
    let addr = server.addr;
    let weather = json!({"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["celsius", "fahrenheit"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit"]}}});
    let time = json!({"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}}});
    let check = |call: &Value| {
        let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        let o = args.as_object().unwrap_or_else(|| panic!("{call}"));
        match call["function"]["name"].as_str().unwrap() {
            "get_weather" => {
                assert!(o.keys().all(|k| ["city", "unit", "days"].contains(&k.as_str())), "{args}");
                assert!(o["city"].as_str().is_some_and(|c| c.chars().count() <= 12), "{args}");
                assert!(["celsius", "fahrenheit"].contains(&o["unit"].as_str().unwrap_or_default()), "{args}");
                assert!(o.get("days").is_none_or(|d| d.as_u64().is_some_and(|d| (1..=7).contains(&d))), "{args}");
            }
            "get_time" => {
                assert!(o.len() == 1 && o["zone"].as_str().is_some_and(|z| z.chars().count() <= 8), "{args}")
            }
            other => panic!("{other} is not declared"),
        }
    };
    let request = json!({"messages": [{"role": "user", "content": "Is it cold in Oslo?"}], "tools": [weather, time],
                         "tool_choice": "required", "temperature": 0, "max_tokens": 200, "parallel_tool_calls": false});
    for call in one_forced_call(addr, &request) {
        check(&call);
    }

    let mut named = request.clone();
    named["tool_choice"] = json!({"type": "function", "function": {"name": "get_time"}});
    named["temperature"] = json!(1.0);
    named["seed"] = json!(3);
    let (status, v) = post(addr, "/v1/chat/completions", &named);
    assert_eq!(status, 200, "{v}");
    println!("named: {}", v["choices"][0]["message"]);
    let call = &v["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "get_time", "{v}");
    check(call);
    server.stop().unwrap();
}

/// Twenty `json_schema` requests through the official `openai` Python client
/// (tools/server-test/openai_json_schema_e2e.py), each reply validated by Python's jsonschema;
/// some streamed.
#[test]
fn openai_python_client_json_schema() {
    let server = start_model(ts_testkit::real_model(QWEN), 2048, false, None, None);
    run_openai_script("openai_json_schema_e2e.py", &server);
    server.stop().unwrap();
}

/// The chat page at `/`: one self-contained HTML file, then driven in headless Chromium by
/// tools/server-test/chat_page_browser.py (selenium with Debian's chromium-driver, from
/// tools/server-test/fetch-chromium.sh): a streamed reply seen growing with its tok/s, a long
/// reply stopped mid-way and cancelled by the server, a third turn carrying the conversation.
/// The screenshot lands in the test's target directory (docs/chat-page.png is a copy).
#[test]
fn chat_page_in_a_browser() {
    let server = start(2048);
    let (status, head, page) = http(server.addr, "GET", "/", b"");
    assert_eq!(status, 200);
    assert!(head.to_ascii_lowercase().contains("content-type: text/html"), "{head}");
    assert!(page.contains("id=\"prompt\"") && !page.contains("://"), "the page must load nothing from elsewhere");
    let screenshot = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("chat-page.png");
    let _ = std::fs::remove_file(&screenshot);
    let base = format!("http://{}", server.addr);
    run_client_script("chat_page_browser.py", &[base.as_ref(), ID.as_ref(), screenshot.as_os_str()]);
    let png = std::fs::read(&screenshot).unwrap();
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "the screenshot is not a PNG");
    server.stop().unwrap();
}

/// The model's MTP head guessing in the server (`--spec-mtp`, an MTP head per slot, four
/// slots, `--prompt-cache`): on the MTP fixtures (qwen3_5_moe F32 and Q8_0, qwen3_next F32)
/// greedy replies equal those of a server that does not guess, one request at a time, two at
/// once, and a second turn that reuses the first's cached prompt; the head guessed. A model
/// without a nextn layer is refused by name before the server starts.
#[test]
fn mtp_head_keeps_greedy_replies() {
    let start = |path: &std::path::Path, spec: bool| {
        let load = || Engine::load(path, &LoadOptions { threads: 2, experts: ExpertPlacement::Mapped }).unwrap();
        let opts = ServeOptions {
            model_id: ID.into(),
            parallel: 4,
            slot_ctx: 512,
            max_body: 1 << 20,
            prompt_cache: true,
            spec: spec.then(SpecOptions::default),
            draft_p_min: DEFAULT_P_MIN,
            spec_mtp: spec,
        };
        ts_server::spawn(load(), opts, "127.0.0.1:0".parse().unwrap())
    };
    let prompts = ["Tell me about the sea.", "one two three four, one two three four, one two"];
    for file in ["qwen3_5_moe/model-f32.gguf", "qwen3_5_moe/model-q8_0.gguf", "qwen3_next/model-f32.gguf"] {
        let path = ts_testkit::fixtures_dir().join(file);
        let (plain, guessing) = (start(&path, false).unwrap(), start(&path, true).unwrap());
        let ask = |addr, messages: &Value| {
            let req = json!({"model": ID, "messages": messages, "max_tokens": 24, "temperature": 0});
            let (status, v) = post(addr, "/v1/chat/completions", &req);
            assert_eq!(status, 200, "{v}");
            content(&v)
        };
        let turns: Vec<Value> = prompts.iter().map(|p| json!([{"role": "user", "content": p}])).collect();
        let want: Vec<String> = turns.iter().map(|t| ask(plain.addr, t)).collect();
        for (t, w) in turns.iter().zip(&want) {
            assert_eq!(&ask(guessing.addr, t), w, "{file}: alone");
        }
        let together: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = turns.iter().map(|t| s.spawn(move || ask(guessing.addr, t))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(together, want, "{file}: together");
        // A second turn: its start is read from the slot's cache, which the head saw too.
        let mut second = turns[0].as_array().unwrap().clone();
        second.push(json!({"role": "assistant", "content": want[0]}));
        second.push(json!({"role": "user", "content": "And the mountains?"}));
        let second = Value::Array(second);
        assert_eq!(ask(guessing.addr, &second), ask(plain.addr, &second), "{file}: second turn");
        let drafted = metric(guessing.addr, "spec_drafted_total");
        println!("{file}: {} of {drafted} guesses kept", metric(guessing.addr, "spec_accepted_total"));
        assert!(drafted > 0.0, "{file}: the MTP head guessed nothing");
        plain.stop().unwrap();
        guessing.stop().unwrap();
    }
    let err = start(&ts_testkit::fixtures_dir().join("llama/model-q8_0.gguf"), true).err().expect("refused");
    assert!(err.contains("--spec-mtp"), "{err}");
}

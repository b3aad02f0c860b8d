//! The OpenAI-compatible endpoints: request validation, prompt rendering and
//! tokenization, and the answers (whole, or as server-sent events).

use crate::request::{
    ChatFields, ChatTools, CompletionFields, DetokenizeBody, Generation, ResponseFormat, Stop, TokenizeBody,
    ToolChoice, typed,
};
use crate::scheduler::{Choice, Event, Finish, Job, TokenChoice, TokenLogprob, token_bytes};
use crate::{AppState, ServeOptions};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::UnboundedReceiver;
use ts_engine::chat::reply::{ReplyEvent, ReplyParser};
use ts_engine::chat::tool_calls::{ToolSyntax, forced_calls_grammar};
use ts_engine::chat::{FunctionCall, TemplateKwargs};
use ts_engine::constraint::{Constraint, Grammar};
use ts_engine::sampler::{SamplerConfig, random_seed};
use ts_engine::speculative::SpecOptions;
use ts_model::Backend;

/// An error answered the OpenAI way: a status and `{"error": {...}}`.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    /// The field at fault, as a path (`messages[0].content`).
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn bad(message: impl Into<String>, param: Option<&'static str>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_owned),
            code: None,
        }
    }

    /// A 400 about the field at `param` (a path).
    pub fn bad_field(message: impl Into<String>, param: String) -> ApiError {
        ApiError { param: Some(param), ..ApiError::bad(message, None) }
    }

    fn with_param(mut self, param: &str) -> ApiError {
        self.param = Some(param.to_owned());
        self
    }

    fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    pub fn status(status: StatusCode, message: impl Into<String>) -> ApiError {
        let kind = if status.is_server_error() { "server_error" } else { "invalid_request_error" };
        ApiError { status, message: message.into(), kind, param: None, code: None }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body =
            json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}});
        (self.status, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
    }
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// The request body as JSON, or the error a client should see.
fn parse_body(body: Result<Bytes, BytesRejection>, opts: &ServeOptions) -> Result<Value, ApiError> {
    let bytes = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::status(StatusCode::PAYLOAD_TOO_LARGE, format!("the body is over {} bytes", opts.max_body))
        } else {
            ApiError::bad(format!("could not read the body: {e}"), None)
        }
    })?;
    let v: Value =
        serde_json::from_slice(&bytes).map_err(|e| ApiError::bad(format!("the body is not valid JSON: {e}"), None))?;
    if !v.is_object() {
        return Err(ApiError::bad("the body must be a JSON object", None));
    }
    Ok(v)
}

/// `x` when it lies in `lo..=hi`, else an error naming `name`.
fn in_range(x: Option<f64>, name: &'static str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
    match x {
        Some(f) if !(lo..=hi).contains(&f) => {
            Err(ApiError::bad(format!("'{name}' is {f}; it must be between {lo} and {hi}"), Some(name)))
        }
        x => Ok(x),
    }
}

/// The model's tokenizer, or a server error.
fn tokenizer_of<B: Backend>(st: &AppState<B>) -> Result<&ts_tokenizer::Tokenizer, ApiError> {
    st.engine.tokenizer().map_err(|e| ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

/// `ids` as token ids of a vocabulary of `n_vocab` (`None`: not a non-negative integer), or
/// an error naming `param`.
fn token_ids(
    ids: impl IntoIterator<Item = Option<u64>>,
    n_vocab: usize,
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    ids.into_iter()
        .map(|id| id.filter(|&id| id < n_vocab as u64).map(|id| id as u32))
        .collect::<Option<Vec<u32>>>()
        .ok_or_else(|| ApiError::bad(format!("'{param}' must hold token ids below {n_vocab}"), Some(param)))
}

/// What every generation request shares, validated.
struct Common {
    /// As asked; 0 only for a completion that echoes and scores its prompt.
    max_tokens: Option<u64>,
    sampler: SamplerConfig,
    stop: Vec<String>,
    stream: bool,
    include_usage: bool,
    /// Log-probabilities asked for: how many alternatives per token.
    logprobs: Option<usize>,
    /// Score the prompt too (a completion with `echo` and `logprobs`).
    score_prompt: bool,
    /// Choices to generate, each its own sequence (seeds `seed`, `seed + 1`, ...).
    n: usize,
    /// `speculative.n_max` and `speculative.n_min` where given (llama-server's names): the
    /// most and fewest guesses per step when the server guesses (`--spec-ngram`); n_max 0
    /// turns guessing off for this request.
    spec_max: Option<usize>,
    spec_min: Option<usize>,
    /// The grammar replies are held to, and the field a grammar that does not compile is blamed on.
    grammar: Option<(Grammar, String)>,
}

/// The most choices one request may ask for (`n`).
const MAX_CHOICES: usize = 16;

impl Common {
    fn require_max_tokens(&self) -> Result<(), ApiError> {
        if self.max_tokens == Some(0) {
            return Err(ApiError::bad("'max_tokens' must be at least 1", Some("max_tokens")));
        }
        Ok(())
    }
}

fn common(g: Generation, model_id: &str) -> Result<Common, ApiError> {
    if let Some(m) = g.model
        && m != model_id
    {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("the model '{m}' does not exist; this server serves '{model_id}'"),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        });
    }
    let n = match g.n {
        None => 1,
        Some(n) if (1..=MAX_CHOICES as u64).contains(&n) => n as usize,
        Some(n) => {
            return Err(ApiError::bad(format!("'n' is {n}; it must be between 1 and {MAX_CHOICES}"), Some("n")));
        }
    };
    let max_tokens = g.max_completion_tokens.or(g.max_tokens);
    let unsupported = |name: &'static str, why: &str| {
        Err(ApiError::bad(format!("'{name}' is not supported by this server: {why}"), Some(name)))
    };
    if g.functions.is_some() {
        return unsupported("functions", "the legacy function calling; use 'tools'");
    }
    if g.function_call.is_some() {
        return unsupported("function_call", "the legacy function calling; use 'tool_choice'");
    }
    let grammar = match g.response_format {
        None => None,
        Some(f) => response_format_grammar(f)?,
    };
    let temperature = in_range(g.temperature, "temperature", 0.0, 2.0)?.unwrap_or(1.0) as f32;
    let top_p = in_range(g.top_p, "top_p", 0.0, 1.0)?.unwrap_or(1.0) as f32;
    let presence = in_range(g.presence_penalty, "presence_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32;
    let frequency = in_range(g.frequency_penalty, "frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32;
    let seed = match g.seed {
        None => random_seed(),
        Some(x) => x
            .as_i64()
            .map(|s| s as u64)
            .or_else(|| x.as_u64())
            .ok_or_else(|| ApiError::bad(format!("'seed' must be an integer, not {x}"), Some("seed")))?,
    };
    let stop = match g.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(a)) if a.len() > 4 => {
            return Err(ApiError::bad("'stop' has more than 4 sequences", Some("stop")));
        }
        Some(Stop::Many(a)) => a,
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::bad("'stop' sequences must not be empty", Some("stop")));
    }
    let stream = g.stream.unwrap_or(false);
    let include_usage = g.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
    // llama-server's extensions, off unless given.
    let top_k = g.top_k.unwrap_or(0) as usize;
    let min_p = in_range(g.min_p, "min_p", 0.0, 1.0)?.unwrap_or(0.0) as f32;
    let repeat_penalty = in_range(g.repeat_penalty, "repeat_penalty", 1e-3, 1e3)?.unwrap_or(1.0) as f32;
    let logit_bias = g
        .logit_bias
        .unwrap_or_default()
        .into_iter()
        .map(|(k, b)| {
            let id = k.parse::<u32>().map_err(|_| {
                ApiError::bad(format!("'logit_bias' keys are token ids; '{k}' is not one"), Some("logit_bias"))
            })?;
            if !(-100.0..=100.0).contains(&b) {
                return Err(ApiError::bad(
                    format!("'logit_bias' of token {id} is {b}; it must be between -100 and 100"),
                    Some("logit_bias"),
                ));
            }
            Ok((id, b as f32))
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let penalized = presence != 0.0 || frequency != 0.0 || repeat_penalty != 1.0;
    let sampler = SamplerConfig {
        temperature,
        top_p,
        presence_penalty: presence,
        frequency_penalty: frequency,
        repeat_last_n: if penalized { 64 } else { 0 },
        top_k,
        min_p,
        repeat_penalty,
        logit_bias,
        seed,
    };
    Ok(Common {
        max_tokens,
        sampler,
        stop,
        stream,
        include_usage,
        logprobs: None,
        score_prompt: false,
        n,
        spec_max: g.spec_max.map(|n| n as usize),
        spec_min: g.spec_min.map(|n| n as usize),
        grammar,
    })
}

/// The grammar `response_format` asks for: none for `text`, any JSON object for
/// `json_object`, JSON valid under the schema for `json_schema`.
fn response_format_grammar(f: ResponseFormat) -> Result<Option<(Grammar, String)>, ApiError> {
    match f.kind.as_str() {
        "text" => Ok(None),
        "json_object" => Ok(Some((Grammar::JsonObject, "response_format".into()))),
        "json_schema" => {
            let spec = f.json_schema.ok_or_else(|| {
                ApiError::bad("'response_format.json_schema' is required with type 'json_schema'", None)
                    .with_param("response_format.json_schema")
            })?;
            let schema = spec.schema.map_or(json!({}), Value::Object);
            Ok(Some((Grammar::JsonSchema(schema), "response_format.json_schema.schema".into())))
        }
        other => Err(ApiError::bad(
            format!("'response_format.type' is '{other}'; it must be 'text', 'json_object' or 'json_schema'"),
            None,
        )
        .with_param("response_format.type")),
    }
}

/// Chat's `logprobs` (true or false) and `top_logprobs` (0 to 20, with logprobs).
fn chat_logprobs(f: &ChatFields) -> Result<Option<usize>, ApiError> {
    if let Some(n) = f.top_logprobs
        && n > 20
    {
        return Err(ApiError::bad(format!("'top_logprobs' is {n}; it must be between 0 and 20"), Some("top_logprobs")));
    }
    match (f.logprobs.unwrap_or(false), f.top_logprobs) {
        (true, n) => Ok(Some(n.unwrap_or(0) as usize)),
        (false, Some(_)) => Err(ApiError::bad("'top_logprobs' needs 'logprobs': true", Some("top_logprobs"))),
        (false, None) => Ok(None),
    }
}

/// A completion's `logprobs`: how many alternatives per token, 0 to 5.
fn completion_logprobs(f: &CompletionFields) -> Result<Option<usize>, ApiError> {
    match f.logprobs {
        Some(n) if n > 5 => {
            Err(ApiError::bad(format!("'logprobs' is {n}; it must be between 0 and 5"), Some("logprobs")))
        }
        n => Ok(n.map(|n| n as usize)),
    }
}

/// A token's text for the client: its bytes, with invalid UTF-8 replaced.
fn token_text(c: &TokenChoice) -> String {
    String::from_utf8_lossy(&c.bytes).into_owned()
}

/// A log-probability JSON can hold: minus infinity (a masked token) as -9999, as OpenAI does.
fn finite(lp: f32) -> f32 {
    lp.max(-9999.0)
}

/// Chat's `logprobs.content` entries.
fn chat_logprob_entries(entries: &[TokenLogprob]) -> Value {
    let one = |c: &TokenChoice| json!({"token": token_text(c), "logprob": finite(c.logprob), "bytes": c.bytes});
    Value::Array(
        entries
            .iter()
            .map(|t| {
                let mut e = one(&t.chosen);
                e["top_logprobs"] = Value::Array(t.top.iter().map(one).collect());
                e
            })
            .collect(),
    )
}

/// A completion's `logprobs` object for `entries`, whose text starts `offset`
/// characters into the reply, after `lead`: a scored prompt's first token and
/// the characters of text it stands for; it has no log-probability (null, as
/// OpenAI gives it). Each `top_logprobs` map holds the most likely tokens,
/// most likely first, and the chosen one (as OpenAI's does).
fn completion_logprob_object(lead: Option<(String, usize)>, entries: &[TokenLogprob], mut offset: usize) -> Value {
    let (mut tokens, mut logprobs, mut top, mut text_offset) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    if let Some((t, width)) = lead {
        text_offset.push(offset);
        offset += width;
        tokens.push(t);
        logprobs.push(Value::Null);
        top.push(Value::Null);
    }
    for t in entries {
        let text = token_text(&t.chosen);
        text_offset.push(offset);
        offset += text.chars().count();
        let mut alternatives: serde_json::Map<String, Value> =
            t.top.iter().map(|c| (token_text(c), json!(finite(c.logprob)))).collect();
        alternatives.entry(text.clone()).or_insert(json!(finite(t.chosen.logprob)));
        tokens.push(text);
        logprobs.push(json!(finite(t.chosen.logprob)));
        top.push(Value::Object(alternatives));
    }
    json!({"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": text_offset})
}

/// Queues a job per choice for `prompt`: the request's id, the receivers of
/// the choices' events, and the prompt's length.
fn submit<B: Backend>(
    st: &AppState<B>,
    prompt: Vec<u32>,
    c: &Common,
    special: bool,
    checkpoint: Option<usize>,
) -> Result<(String, Vec<UnboundedReceiver<Event>>, usize), ApiError> {
    let n_ctx = st.opts.slot_ctx;
    if prompt.is_empty() {
        return Err(ApiError::bad("the prompt is empty", None));
    }
    let n_vocab = tokenizer_of(st)?.vocab_size();
    if let Some(&(id, _)) = c.sampler.logit_bias.iter().find(|&&(id, _)| id as usize >= n_vocab) {
        return Err(ApiError::bad(
            format!("'logit_bias' names token {id}; the vocabulary has {n_vocab}"),
            Some("logit_bias"),
        ));
    }
    if prompt.len() >= n_ctx {
        return Err(ApiError::bad(
            format!("the prompt has {} tokens; this server's context per request is {n_ctx}", prompt.len()),
            None,
        )
        .with_code("context_length_exceeded"));
    }
    let room = n_ctx - prompt.len();
    let max_tokens = match c.max_tokens {
        None => room,
        Some(n) if n as usize <= room => n as usize,
        Some(n) => {
            return Err(ApiError::bad(
                format!("'max_tokens' is {n}, more than the {room} tokens left in the context after the prompt"),
                Some("max_tokens"),
            )
            .with_code("context_length_exceeded"));
        }
    };
    let constraint = match &c.grammar {
        None => None,
        Some((grammar, param)) => Some(compile(st, grammar, param)?),
    };
    let id = format!("{:x}{:06x}", now_secs(), st.next_id.fetch_add(1, Relaxed));
    let prompt_tokens = prompt.len();
    let mut receivers = Vec::with_capacity(c.n);
    let mut choices = Vec::with_capacity(c.n);
    for choice in 0..c.n {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut sampler = c.sampler.clone();
        sampler.seed = sampler.seed.wrapping_add(choice as u64);
        let id = if c.n == 1 { id.clone() } else { format!("{id}.{choice}") };
        choices.push(Choice { id, sampler, events: tx });
        receivers.push(rx);
    }
    let job = Job {
        prompt,
        max_tokens,
        stop: c.stop.clone(),
        special,
        logprobs: c.logprobs,
        // The first choice scores the prompt for all.
        score_prompt: c.score_prompt,
        checkpoint,
        choices,
        constraint,
        received: Instant::now(),
        spec: st.opts.spec.as_ref().map(|o| SpecOptions {
            draft_max: c.spec_max.unwrap_or(o.draft_max),
            draft_min: c.spec_min.unwrap_or(o.draft_min),
            adapt: o.adapt,
        }),
    };
    st.metrics.queued.fetch_add(1, Relaxed);
    st.jobs
        .lock()
        .expect("job queue lock")
        .send(job)
        .map_err(|_| ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "the server is shutting down"))?;
    Ok((id, receivers, prompt_tokens))
}

/// `grammar` compiled for this model's vocabulary; one llguidance cannot compile is refused
/// naming `param`, with llguidance's reason.
fn compile<B: Backend>(st: &AppState<B>, grammar: &Grammar, param: &str) -> Result<Constraint, ApiError> {
    let grammars = st.engine.grammars().map_err(|e| {
        ApiError::bad(format!("'{param}' cannot be enforced with this model: {e}"), None).with_param(param)
    })?;
    grammars
        .compile(grammar)
        .map_err(|e| ApiError::bad(format!("'{param}' cannot be enforced: {e}"), None).with_param(param))
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// `POST /v1/chat/completions`
pub async fn chat<B: Backend + 'static>(
    State(st): State<Arc<AppState<B>>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    st.metrics.requests.fetch_add(1, Relaxed);
    answer(&st, "chat", chat_inner(&st, body).await)
}

/// The response, or the error's, counted and logged.
fn answer<B: Backend>(st: &AppState<B>, what: &str, r: Result<Response, ApiError>) -> Response {
    r.unwrap_or_else(|e| {
        st.metrics.rejected.fetch_add(1, Relaxed);
        tracing::info!(status = e.status.as_u16(), "{what} request refused: {}", e.message);
        e.into_response()
    })
}

async fn chat_inner<B: Backend + 'static>(
    st: &Arc<AppState<B>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let v = parse_body(body, &st.opts)?;
    let fields: ChatFields = typed(&v, "")?;
    let mut c = common(typed(&v, "")?, &st.opts.model_id)?;
    c.require_max_tokens()?;
    c.logprobs = chat_logprobs(&fields)?;
    let tools = fields.tools()?;
    let messages = fields.messages.ok_or_else(|| ApiError::bad("'messages' is required", Some("messages")))?;
    if messages.is_empty() {
        return Err(ApiError::bad("'messages' is empty", Some("messages")));
    }
    let engine = &st.engine;
    let harmony = engine.model.cfg.arch == ts_model::Arch::GptOss;
    let chatml;
    let template = match &engine.template {
        Some(t) => t,
        None => {
            chatml = ts_engine::chat::ChatTemplate::chatml();
            &chatml
        }
    };
    // The syntax replies are read in; tools a reply could not be read for are refused.
    let syntax = ToolSyntax::of_template(template.source());
    if !tools.declared.is_empty() && !harmony && syntax.is_none() {
        let why = if template.source().contains("tools") {
            "this model's chat template shows tools, but its tool-call syntax is not one this server reads \
             (Hermes <tool_call>, Qwen3-Coder <function=...>, GLM, Gemma 4, gpt-oss harmony)"
        } else {
            "this model's chat template does not show tools to the model"
        };
        return Err(ApiError::bad(format!("'tools' cannot be used: {why}"), Some("tools")));
    }
    if matches!(tools.choice, ToolChoice::Required | ToolChoice::Function(_)) {
        c.grammar = Some(forced_calls(
            st,
            fields.tools.as_deref().unwrap_or_default(),
            &tools,
            template.source(),
            c.grammar.is_some(),
        )?);
    }
    let mut kwargs = TemplateKwargs::new();
    if !tools.declared.is_empty() {
        kwargs = kwargs.set("tools", &tools.declared).map_err(|e| ApiError::bad(e.to_string(), Some("tools")))?;
    }
    let rendered = template
        .render_with(&messages, true, &kwargs)
        .map_err(|e| ApiError::bad(format!("the chat template failed on these messages: {e}"), Some("messages")))?;
    let tokenizer = tokenizer_of(st)?;
    let prompt = tokenizer
        .encode(&rendered, false, true)
        .map_err(|e| ApiError::bad(format!("tokenizing the prompt: {e}"), Some("messages")))?;
    if harmony && c.logprobs.is_some() {
        // Its tokens mix the reply, the reasoning and channel markers: no honest per-token content list.
        return Err(ApiError::bad("'logprobs' is not available for gpt-oss's harmony replies", Some("logprobs")));
    }
    // A model with recurrent layers keeps a snapshot where this conversation ends, for its next turn.
    let checkpoint = match (&engine.template, st.opts.prompt_cache && engine.model.is_recurrent()) {
        (Some(t), true) => ts_engine::reuse::conversation_end(t, &messages, &kwargs, tokenizer, &prompt),
        _ => None,
    };
    let calls_read = !tools.declared.is_empty();
    let special = harmony || (calls_read && syntax.is_some_and(ToolSyntax::needs_special_tokens));
    let (id, receivers, prompt_tokens) = submit(st, prompt, &c, special, checkpoint)?;
    let id = format!("chatcmpl-{id}");
    let declared = Arc::new(tools.declared);
    let parser = move || {
        if harmony { ReplyParser::harmony(calls_read) } else { ReplyParser::plain(syntax, &declared) }
    };
    let most_calls = if tools.parallel { usize::MAX } else { 1 };
    let model = st.opts.model_id.clone();
    let created = now_secs();
    if c.stream {
        let head = StreamHead { id, model, created, object: "chat.completion.chunk" };
        return Ok(stream_choices(head, receivers, c.include_usage, prompt_tokens, |meta, rx, completion| {
            stream_chat(meta, rx, parser(), most_calls, completion)
        }));
    }
    let replies = futures_util::future::join_all(receivers.into_iter().map(|rx| collect(rx, parser()))).await;
    let mut choices = Vec::with_capacity(replies.len());
    let mut completion = 0;
    for (index, reply) in replies.into_iter().enumerate() {
        let mut reply = reply?;
        reply.calls.truncate(most_calls);
        let content =
            if reply.calls.is_empty() || !reply.content.trim().is_empty() { json!(reply.content) } else { Value::Null };
        let mut message = json!({"role": "assistant", "content": content});
        if !reply.reasoning.is_empty() {
            message["reasoning_content"] = json!(reply.reasoning);
        }
        if !reply.calls.is_empty() {
            let calls: Vec<Value> = reply.calls.iter().map(|f| tool_call_json(&new_call_id(), f)).collect();
            message["tool_calls"] = Value::Array(calls);
        }
        let logprobs = match c.logprobs {
            Some(_) => json!({"content": chat_logprob_entries(&reply.logprobs)}),
            None => Value::Null,
        };
        completion += reply.completion_tokens;
        let finish = finish_reason(reply.finish, !reply.calls.is_empty());
        choices.push(json!({"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs}));
    }
    let body = json!({
        "id": id, "object": "chat.completion", "created": created, "model": model,
        "choices": choices, "usage": usage(prompt_tokens, completion),
    });
    Ok(Json(body).into_response())
}

/// The grammar that holds a reply to calls of the declared tools (`tool_choice` required or
/// named; `all`: the request's `tools`), each function's `parameters` checked to compile first so that one llguidance
/// cannot compile is refused by its path.
fn forced_calls<B: Backend>(
    st: &AppState<B>,
    all: &[Value],
    tools: &ChatTools,
    template: &str,
    json_asked: bool,
) -> Result<(Grammar, String), ApiError> {
    if json_asked {
        return Err(ApiError::bad(
            "'response_format' cannot be combined with 'tool_choice' 'required' or a named function: the reply is a tool call",
            Some("response_format"),
        ));
    }
    let Some(lark) = forced_calls_grammar(template, &tools.declared, tools.parallel) else {
        return Err(ApiError::bad(
            "'tool_choice' 'required' or a named function cannot be enforced with this model: its tool calls \
             are in no syntax this server can hold a reply to (Hermes JSON, Qwen3-Coder XML, GLM, Gemma 4, \
             gpt-oss harmony); use 'auto'",
            Some("tool_choice"),
        ));
    };
    for decl in &tools.declared {
        let name = &decl["function"]["name"];
        let i = all.iter().position(|t| &t["function"]["name"] == name).unwrap_or_default();
        if let Some(p) = decl["function"].get("parameters") {
            compile(st, &Grammar::JsonSchema(p.clone()), &format!("tools[{i}].function.parameters"))?;
        }
    }
    Ok((Grammar::Lark(lark), "tool_choice".into()))
}

/// `tool_calls` when the model stopped after calling tools.
fn finish_reason(finish: Finish, called: bool) -> &'static str {
    if called && finish == Finish::Stop { "tool_calls" } else { finish.as_str() }
}

/// A tool call's id: `call_` and 24 random letters and digits, as OpenAI's look.
fn new_call_id() -> String {
    use rand::Rng;
    let tail: String = rand::rng().sample_iter(rand::distr::Alphanumeric).take(24).map(char::from).collect();
    format!("call_{tail}")
}

/// A whole `tool_calls` entry: arguments as JSON text, as OpenAI sends them.
fn tool_call_json(id: &str, call: &FunctionCall) -> Value {
    json!({"id": id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json()}})
}

/// What every chunk of one choice's stream carries.
struct ChunkMeta {
    id: String,
    model: String,
    created: u64,
    index: usize,
}

/// The event a stream sends when its generation fails.
fn error_chunk(message: &str) -> String {
    json!({"error": {"message": message, "type": "server_error"}}).to_string()
}

/// What every chunk of a streamed answer carries.
struct StreamHead {
    id: String,
    model: String,
    created: u64,
    object: &'static str,
}

/// A streamed answer: every choice's chunks as they come (`choice` makes one
/// choice's stream, which adds its generated tokens to the counter), then,
/// once all have ended, the usage chunk if asked for and `[DONE]`.
fn stream_choices<S: futures_util::Stream<Item = String> + Send + 'static>(
    head: StreamHead,
    receivers: Vec<UnboundedReceiver<Event>>,
    include_usage: bool,
    prompt_tokens: usize,
    choice: impl Fn(ChunkMeta, UnboundedReceiver<Event>, Arc<std::sync::atomic::AtomicUsize>) -> S,
) -> Response {
    let completion = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let choices: Vec<_> = receivers
        .into_iter()
        .enumerate()
        .map(|(index, rx)| {
            let meta = ChunkMeta { id: head.id.clone(), model: head.model.clone(), created: head.created, index };
            Box::pin(choice(meta, rx, completion.clone()))
        })
        .collect();
    let end = futures_util::stream::once(async move {
        let mut out = Vec::new();
        if include_usage {
            let u = usage(prompt_tokens, completion.load(Relaxed));
            let StreamHead { id, model, created, object } = head;
            out.push(
                json!({"id": id, "object": object, "created": created, "model": model, "choices": [], "usage": u})
                    .to_string(),
            );
        }
        out.push("[DONE]".to_string());
        futures_util::stream::iter(out)
    });
    use futures_util::StreamExt;
    sse(futures_util::stream::select_all(choices).chain(end.flatten()))
}

/// A whole generation.
struct Reply {
    content: String,
    reasoning: String,
    calls: Vec<FunctionCall>,
    /// The tokens' log-probabilities, when asked for.
    logprobs: Vec<TokenLogprob>,
    /// The prompt's, after its first token, when it was scored.
    prompt_logprobs: Vec<TokenLogprob>,
    finish: Finish,
    completion_tokens: usize,
}

/// Waits for a whole generation.
async fn collect(mut rx: UnboundedReceiver<Event>, mut parser: ReplyParser) -> Result<Reply, ApiError> {
    let (mut content, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
    let (mut all, mut prompt) = (Vec::new(), Vec::new());
    let mut take = |events: Vec<ReplyEvent>| {
        for event in events {
            match event {
                ReplyEvent::Content(t) => content += &t,
                ReplyEvent::Reasoning(t) => reasoning += &t,
                ReplyEvent::ToolCall(c) => calls.push(c),
            }
        }
    };
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Prompt(entries) => prompt.extend(entries),
            Event::Text { text, logprobs } => {
                take(parser.feed(&text));
                all.extend(logprobs);
            }
            Event::Done { finish, completion_tokens, .. } => {
                take(parser.finish());
                return Ok(Reply {
                    content,
                    reasoning,
                    calls,
                    logprobs: all,
                    prompt_logprobs: prompt,
                    finish,
                    completion_tokens,
                });
            }
            Event::Error(e) => return Err(ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, e)),
        }
    }
    Err(ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, "the generation ended without a result"))
}

struct Json(Value);

impl IntoResponse for Json {
    fn into_response(self) -> Response {
        ([(header::CONTENT_TYPE, "application/json")], self.0.to_string()).into_response()
    }
}

/// A response of server-sent events from a stream of `data:` payloads.
fn sse(events: impl futures_util::Stream<Item = String> + Send + 'static) -> Response {
    use futures_util::StreamExt;
    let body = events.map(|data| Ok::<_, std::convert::Infallible>(Bytes::from(format!("data: {data}\n\n"))));
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .expect("valid response")
}

/// One choice's chat chunks: the role first, content, reasoning and tool-call
/// deltas (each call as OpenAI streams it: index, id, type and name, then its
/// arguments; at most `most_calls`), the finish reason; its generated tokens
/// are added to `completion` at the end.
fn stream_chat(
    meta: ChunkMeta,
    rx: UnboundedReceiver<Event>,
    parser: ReplyParser,
    most_calls: usize,
    completion: Arc<std::sync::atomic::AtomicUsize>,
) -> impl futures_util::Stream<Item = String> + Send + 'static {
    let chunk = move |delta: Value, finish: Option<&str>, logprobs: Value| {
        json!({"id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
               "choices": [{"index": meta.index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]})
    };
    let first = chunk(json!({"role": "assistant", "content": ""}), None, Value::Null).to_string();
    struct S<F> {
        rx: UnboundedReceiver<Event>,
        parser: ReplyParser,
        chunk: F,
        queue: std::collections::VecDeque<String>,
        calls: usize,
        most_calls: usize,
        done: bool,
        completion: Arc<std::sync::atomic::AtomicUsize>,
    }
    impl<F: Fn(Value, Option<&str>, Value) -> Value> S<F> {
        /// Queues the chunks of `events`; the first carries `logprobs` (tokens
        /// whose text is held back come with a later chunk).
        fn push(&mut self, events: Vec<ReplyEvent>, mut logprobs: Value) {
            for event in events {
                let delta = match event {
                    ReplyEvent::Content(t) => json!({"content": t}),
                    ReplyEvent::Reasoning(t) => json!({"reasoning_content": t}),
                    ReplyEvent::ToolCall(_) if self.calls == self.most_calls => continue,
                    ReplyEvent::ToolCall(call) => {
                        let index = self.calls;
                        self.calls += 1;
                        let head = json!({"tool_calls": [{"index": index, "id": new_call_id(), "type": "function",
                                                          "function": {"name": call.name, "arguments": ""}}]});
                        self.queue.push_back((self.chunk)(head, None, Value::Null).to_string());
                        json!({"tool_calls": [{"index": index, "function": {"arguments": call.arguments_json()}}]})
                    }
                };
                self.queue.push_back((self.chunk)(delta, None, std::mem::take(&mut logprobs)).to_string());
            }
            if !logprobs.is_null() {
                self.queue.push_back((self.chunk)(json!({"content": ""}), None, logprobs).to_string());
            }
        }
    }
    let s = S { rx, parser, chunk, queue: [first].into(), calls: 0, most_calls, done: false, completion };
    futures_util::stream::unfold(s, move |mut s| async move {
        loop {
            if let Some(x) = s.queue.pop_front() {
                return Some((x, s));
            }
            if s.done {
                return None;
            }
            match s.rx.recv().await {
                Some(Event::Text { text, logprobs }) => {
                    let events = s.parser.feed(&text);
                    let lp = if logprobs.is_empty() {
                        Value::Null
                    } else {
                        json!({"content": chat_logprob_entries(&logprobs)})
                    };
                    s.push(events, lp);
                }
                Some(Event::Prompt(_)) => {}
                Some(Event::Done { finish, completion_tokens, .. }) => {
                    let events = s.parser.finish();
                    s.push(events, Value::Null);
                    s.completion.fetch_add(completion_tokens, Relaxed);
                    let finish = finish_reason(finish, s.calls > 0);
                    s.queue.push_back((s.chunk)(json!({}), Some(finish), Value::Null).to_string());
                    s.done = true;
                }
                Some(Event::Error(e)) => {
                    s.queue.push_back(error_chunk(&e));
                    s.done = true;
                }
                None => return None,
            }
        }
    })
}

/// `POST /v1/completions`
pub async fn completions<B: Backend + 'static>(
    State(st): State<Arc<AppState<B>>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    st.metrics.requests.fetch_add(1, Relaxed);
    answer(&st, "completion", completions_inner(&st, body).await)
}

async fn completions_inner<B: Backend + 'static>(
    st: &Arc<AppState<B>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let v = parse_body(body, &st.opts)?;
    let fields: CompletionFields = typed(&v, "")?;
    let mut c = common(typed(&v, "")?, &st.opts.model_id)?;
    if fields.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::bad("'suffix' is not supported by this server: no insertion", Some("suffix")));
    }
    if fields.best_of.is_some_and(|b| b != 1) {
        return Err(ApiError::bad(
            "'best_of' is not supported by this server: one candidate per request",
            Some("best_of"),
        ));
    }
    c.logprobs = completion_logprobs(&fields)?;
    let echo = fields.echo.unwrap_or(false);
    // `echo` with `logprobs` scores the prompt (how evaluation harnesses ask for a text's
    // log-likelihood, usually with max_tokens 0).
    c.score_prompt = echo && c.logprobs.is_some();
    if !echo {
        c.require_max_tokens()?;
    }
    if c.score_prompt && c.stream {
        return Err(ApiError::bad("'echo' with 'logprobs' is answered whole: ask without 'stream'", Some("stream")));
    }
    let tokenizer = tokenizer_of(st)?;
    let encode = |text: &str| {
        tokenizer
            .encode(text, true, true)
            .map_err(|e| ApiError::bad(format!("tokenizing the prompt: {e}"), Some("prompt")))
    };
    // Token ids are taken as they are (no BOS added); their text is their pieces, control
    // tokens' markers included. A one-element array holds the prompt (as batching clients send).
    let prompt = match &fields.prompt {
        Some(Value::Array(a)) if a.len() == 1 && (a[0].is_string() || a[0].is_array()) => &a[0],
        p => p.as_ref().unwrap_or(&Value::Null),
    };
    let (prompt, tokens, bos_added) = match prompt {
        Value::String(s) => {
            let tokens = encode(s)?;
            let bos_added = tokenizer.add_bos() && tokens.first() == tokenizer.bos().as_ref();
            (s.clone(), tokens, bos_added)
        }
        Value::Array(a) if !a.is_empty() && a.iter().all(Value::is_u64) => {
            let ids = token_ids(a.iter().map(Value::as_u64), tokenizer.vocab_size(), "prompt")?;
            let text = ids.iter().map(|&id| String::from_utf8_lossy(&token_bytes(tokenizer, id, true)).into_owned());
            (text.collect(), ids, false)
        }
        Value::Null => return Err(ApiError::bad("'prompt' is required", Some("prompt"))),
        x => {
            return Err(ApiError::bad(
                format!("'prompt' must be a string, one string in an array, or an array of token ids, not {x}"),
                Some("prompt"),
            ));
        }
    };
    if tokens.is_empty() {
        return Err(ApiError::bad("the prompt is empty", Some("prompt")));
    }
    // A scored prompt's first token has no log-probability; a BOS the tokenizer added
    // stands for no text of the prompt.
    let lead = c.score_prompt.then(|| {
        let text = String::from_utf8_lossy(&token_bytes(tokenizer, tokens[0], true)).into_owned();
        let width = if bos_added { 0 } else { text.chars().count() };
        (text, width)
    });
    let (id, receivers, prompt_tokens) = submit(st, tokens, &c, false, None)?;
    let id = format!("cmpl-{id}");
    let model = st.opts.model_id.clone();
    let created = now_secs();
    let echoed = if echo { prompt } else { String::new() };
    let want_logprobs = c.logprobs.is_some();
    if c.stream {
        let head = StreamHead { id, model, created, object: "text_completion" };
        return Ok(stream_choices(head, receivers, c.include_usage, prompt_tokens, |meta, rx, completion| {
            stream_completion(meta, rx, echoed.clone(), want_logprobs, completion)
        }));
    }
    let replies =
        futures_util::future::join_all(receivers.into_iter().map(|rx| collect(rx, ReplyParser::plain(None, &[]))))
            .await;
    let mut choices = Vec::with_capacity(replies.len());
    let mut completion = 0;
    // Only the first choice scores the prompt (the same for all).
    let mut prompt_logprobs = Vec::new();
    for (index, reply) in replies.into_iter().enumerate() {
        let reply = reply?;
        if index == 0 {
            prompt_logprobs = reply.prompt_logprobs;
        }
        let logprobs = if want_logprobs {
            let entries: Vec<TokenLogprob> = prompt_logprobs.iter().chain(&reply.logprobs).cloned().collect();
            completion_logprob_object(lead.clone(), &entries, 0)
        } else {
            Value::Null
        };
        completion += reply.completion_tokens;
        choices.push(json!({"index": index, "text": echoed.clone() + &reply.content,
                            "finish_reason": reply.finish.as_str(), "logprobs": logprobs}));
    }
    Ok(Json(json!({
        "id": id, "object": "text_completion", "created": created, "model": model,
        "choices": choices, "usage": usage(prompt_tokens, completion),
    }))
    .into_response())
}

/// One choice's completion chunks: the echoed prompt if any, text deltas, the
/// finish reason; its generated tokens are added to `completion` at the end.
fn stream_completion(
    meta: ChunkMeta,
    rx: UnboundedReceiver<Event>,
    echoed: String,
    want_logprobs: bool,
    completion: Arc<std::sync::atomic::AtomicUsize>,
) -> impl futures_util::Stream<Item = String> + Send + 'static {
    let meta = Arc::new(meta);
    // State: events, characters of text sent so far (for text_offset), the echo still to send, done.
    futures_util::stream::unfold((rx, 0usize, echoed, false), move |(mut rx, sent, echoed, done)| {
        let (meta, completion) = (meta.clone(), completion.clone());
        async move {
            if done {
                return None;
            }
            let chunk = |text: &str, finish: Option<&str>, logprobs: Value| {
                json!({"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
                       "choices": [{"index": meta.index, "text": text, "finish_reason": finish, "logprobs": logprobs}]})
            };
            if !echoed.is_empty() {
                return Some((chunk(&echoed, None, Value::Null).to_string(), (rx, sent, String::new(), false)));
            }
            let mut ev = rx.recv().await;
            // Prompt scores are not asked for when streaming (refused by the handler).
            while let Some(Event::Prompt(_)) = ev {
                ev = rx.recv().await;
            }
            match ev {
                Some(Event::Text { text, logprobs }) => {
                    let lp = if want_logprobs { completion_logprob_object(None, &logprobs, sent) } else { Value::Null };
                    let sent = sent + logprobs.iter().map(|t| token_text(&t.chosen).chars().count()).sum::<usize>();
                    Some((chunk(&text, None, lp).to_string(), (rx, sent, echoed, false)))
                }
                Some(Event::Done { finish, completion_tokens, .. }) => {
                    completion.fetch_add(completion_tokens, Relaxed);
                    Some((chunk("", Some(finish.as_str()), Value::Null).to_string(), (rx, sent, echoed, true)))
                }
                Some(Event::Error(e)) => Some((error_chunk(&e), (rx, sent, echoed, true))),
                None | Some(Event::Prompt(_)) => None,
            }
        }
    })
}

/// `GET /v1/models`; `max_model_len` is a request's context (as vLLM reports it).
pub async fn models<B: Backend + 'static>(State(st): State<Arc<AppState<B>>>) -> Response {
    Json(json!({"object": "list", "data": [{"id": st.opts.model_id, "object": "model", "created": st.started,
        "owned_by": "turbospark", "max_model_len": st.opts.slot_ctx}]}))
    .into_response()
}

/// `POST /tokenize`: the text of `content` (llama-server's name) or `prompt` (vLLM's) as token
/// ids, with special tokens added when `add_special` / `add_special_tokens` is true (the default)
/// and their markers in the text parsed; `with_pieces` adds each token's text.
pub async fn tokenize<B: Backend + 'static>(
    State(st): State<Arc<AppState<B>>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    json_endpoint(&st, "tokenize", body, tokenize_inner)
}

/// A request answered at once from its JSON body, counted and logged.
fn json_endpoint<B: Backend>(
    st: &AppState<B>,
    what: &str,
    body: Result<Bytes, BytesRejection>,
    handle: fn(&AppState<B>, &Value) -> Result<Response, ApiError>,
) -> Response {
    st.metrics.requests.fetch_add(1, Relaxed);
    answer(st, what, parse_body(body, &st.opts).and_then(|v| handle(st, &v)))
}

fn tokenize_inner<B: Backend>(st: &AppState<B>, v: &Value) -> Result<Response, ApiError> {
    let body: TokenizeBody = typed(v, "")?;
    let (name, text) = match (body.content, body.prompt) {
        (Some(t), _) => ("content", t),
        (None, Some(t)) => ("prompt", t),
        (None, None) => return Err(ApiError::bad("'content' (or 'prompt') is required", Some("content"))),
    };
    let add_special = body.add_special.or(body.add_special_tokens).unwrap_or(true);
    let tokenizer = tokenizer_of(st)?;
    let tokens = tokenizer
        .encode(&text, add_special, true)
        .map_err(|e| ApiError::bad(format!("tokenizing: {e}"), Some(name)))?;
    let mut out = json!({"tokens": tokens, "count": tokens.len(), "max_model_len": st.opts.slot_ctx});
    if body.with_pieces.unwrap_or(false) {
        let piece = |&id: &u32| json!({"id": id, "piece": String::from_utf8_lossy(&token_bytes(tokenizer, id, true))});
        out["tokens"] = Value::Array(tokens.iter().map(piece).collect());
    }
    Ok(Json(out).into_response())
}

/// `POST /detokenize`: `tokens` (ids) as text.
pub async fn detokenize<B: Backend + 'static>(
    State(st): State<Arc<AppState<B>>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    json_endpoint(&st, "detokenize", body, detokenize_inner)
}

fn detokenize_inner<B: Backend>(st: &AppState<B>, v: &Value) -> Result<Response, ApiError> {
    let tokenizer = tokenizer_of(st)?;
    let body: DetokenizeBody = typed(v, "")?;
    let ids = body.tokens.ok_or_else(|| ApiError::bad("'tokens' (token ids) is required", Some("tokens")))?;
    let ids = token_ids(ids.into_iter().map(Some), tokenizer.vocab_size(), "tokens")?;
    // Control tokens as their markers, as llama-server gives them (and /tokenize parses them).
    let bytes =
        tokenizer.detokenize(&ids, false, true).map_err(|e| ApiError::bad(format!("decoding: {e}"), Some("tokens")))?;
    let text = String::from_utf8_lossy(&bytes);
    Ok(Json(json!({"content": text, "prompt": text})).into_response())
}

/// `GET /`: the chat page, one self-contained file (no external assets) that talks to
/// `/v1/chat/completions` on the same server.
pub async fn page() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], include_str!("chat.html")).into_response()
}

/// `GET /health`
pub async fn health() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

/// `GET /metrics`
pub async fn metrics<B: Backend + 'static>(State(st): State<Arc<AppState<B>>>) -> Response {
    let experts = st.engine.model.backend.expert_stats().or_else(|| st.engine.model.experts.stats()).map(|s| {
        let t = s.total();
        (t.hits, t.misses, t.bytes_read)
    });
    let busy = st.metrics.busy.load(Relaxed);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], st.metrics.render(experts, st.opts.parallel, busy))
        .into_response()
}

/// Any other path.
pub async fn not_found(uri: axum::http::Uri) -> Response {
    ApiError::status(StatusCode::NOT_FOUND, format!("no such endpoint: {}", uri.path())).into_response()
}

pub async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    ApiError::status(StatusCode::METHOD_NOT_ALLOWED, format!("{method} is not allowed on {}", uri.path()))
        .into_response()
}

//! Building a [`Tokenizer`] from GGUF metadata, following llama.cpp's
//! `llama_vocab::impl::load` (defaults, overrides and load-time fix-ups).

use crate::bpe::Bpe;
use crate::pretokenize::{BpeFlavor, PreTokenizer, bpe_flavor};
use crate::{SpecialTokens, TokenAttr, Tokenizer, TokenizerError, TokenizerKind};
use std::collections::{BTreeSet, HashMap};
use ts_gguf::{Array, Metadata};

const TOKENS: &str = "tokenizer.ggml.tokens";
const SCORES: &str = "tokenizer.ggml.scores";
const TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
const MERGES: &str = "tokenizer.ggml.merges";

type Field = fn(&mut SpecialTokens) -> &mut Option<u32>;

/// Special-token id keys in the order llama.cpp reads them; the deprecated
/// FIM keys come last and win.
const ID_KEYS: [(&str, Field); 17] = [
    ("tokenizer.ggml.bos_token_id", |s| &mut s.bos),
    ("tokenizer.ggml.eos_token_id", |s| &mut s.eos),
    ("tokenizer.ggml.eot_token_id", |s| &mut s.eot),
    ("tokenizer.ggml.eom_token_id", |s| &mut s.eom),
    ("tokenizer.ggml.unknown_token_id", |s| &mut s.unk),
    ("tokenizer.ggml.seperator_token_id", |s| &mut s.sep),
    ("tokenizer.ggml.padding_token_id", |s| &mut s.pad),
    ("tokenizer.ggml.mask_token_id", |s| &mut s.mask),
    ("tokenizer.ggml.fim_pre_token_id", |s| &mut s.fim_pre),
    ("tokenizer.ggml.fim_suf_token_id", |s| &mut s.fim_suf),
    ("tokenizer.ggml.fim_mid_token_id", |s| &mut s.fim_mid),
    ("tokenizer.ggml.fim_pad_token_id", |s| &mut s.fim_pad),
    ("tokenizer.ggml.fim_rep_token_id", |s| &mut s.fim_rep),
    ("tokenizer.ggml.fim_sep_token_id", |s| &mut s.fim_sep),
    ("tokenizer.ggml.prefix_token_id", |s| &mut s.fim_pre),
    ("tokenizer.ggml.suffix_token_id", |s| &mut s.fim_suf),
    ("tokenizer.ggml.middle_token_id", |s| &mut s.fim_mid),
];

/// Token texts that identify special ids the file does not name, most
/// specific first. llama.cpp takes the first it meets in hash-map order;
/// this list order is the deterministic stand-in.
const DETECTED: [(&[&str], Field); 8] = [
    (
        &[
            "<|eot_id|>",
            "<|im_end|>",
            "<|end|>",
            "<end_of_turn>",
            "<|endoftext|>",
            "<|end_of_text|>",
            "<EOT>",
            "_<EOT>",
            "[EOT]",
            "<｜end▁of▁sentence｜>",
            "<end_of_utterance>",
        ],
        |s| &mut s.eot,
    ),
    (&["<|eom_id|>"], |s| &mut s.eom),
    (
        &[
            "<|fim_prefix|>",
            "<fim-prefix>",
            "<fim_prefix>",
            "<｜fim▁begin｜>",
            "<PRE>",
            "▁<PRE>",
            "<|code_prefix|>",
            "<|prefix|>",
        ],
        |s| &mut s.fim_pre,
    ),
    (
        &[
            "<|fim_suffix|>",
            "<fim-suffix>",
            "<fim_suffix>",
            "<｜fim▁hole｜>",
            "<SUF>",
            "▁<SUF>",
            "<|code_suffix|>",
            "<|suffix|>",
        ],
        |s| &mut s.fim_suf,
    ),
    (
        &[
            "<|fim_middle|>",
            "<fim-middle>",
            "<fim_middle>",
            "<｜fim▁end｜>",
            "<MID>",
            "▁<MID>",
            "<|code_middle|>",
            "<|middle|>",
        ],
        |s| &mut s.fim_mid,
    ),
    (&["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"], |s| &mut s.fim_pad),
    (&["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"], |s| &mut s.fim_rep),
    (&["<|file_sep|>"], |s| &mut s.fim_sep),
];

/// Token texts that end generation (llama.cpp's `special_eog_ids` by text).
const EOG_TEXTS: [&str; 22] = [
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

pub(crate) fn from_metadata(md: &Metadata) -> Result<Tokenizer, TokenizerError> {
    let model = md.req_str("tokenizer.ggml.model")?;
    let pre_key = md.str("tokenizer.ggml.pre")?;
    let (kind, flavor, pre) = match model {
        "llama" => (TokenizerKind::Spm, None, pre_key.unwrap_or("default")),
        "gpt2" => {
            let pre = pre_key.filter(|p| !p.is_empty()).unwrap_or("default");
            let flavor = bpe_flavor(pre).ok_or_else(|| TokenizerError::UnsupportedPreTokenizer(pre.into()))?;
            (TokenizerKind::Bpe, Some(flavor), pre)
        }
        // llama.cpp treats `gemma4` as BPE with the gemma4 pre-tokenizer, whatever the file says.
        "gemma4" => (TokenizerKind::Bpe, bpe_flavor("gemma4"), "gemma4"),
        other => return Err(TokenizerError::UnsupportedModel(other.into())),
    };

    let tokens = md.req_strings(TOKENS)?;
    let n = tokens.len();
    if n == 0 {
        return Err(TokenizerError::EmptyVocabulary);
    }
    if n >= i32::MAX as usize {
        return Err(TokenizerError::VocabularyTooLarge(n));
    }
    let scores = read_scores(md, n)?;
    let mut attrs = read_attrs(md, n)?;

    let mut texts: Vec<Box<str>> = Vec::with_capacity(n);
    let mut ids: HashMap<Box<str>, u32> = HashMap::with_capacity(n);
    for (i, token) in tokens.iter().enumerate() {
        // llama.cpp renames empty tokens so that every text is distinct and non-empty.
        let text: Box<str> = if token.is_empty() { format!("[EMPTY_{i}]").into() } else { token.as_str().into() };
        if let Some(first) = ids.insert(text.clone(), i as u32) {
            return Err(TokenizerError::DuplicateToken { text: text.into(), first, second: i as u32 });
        }
        texts.push(text);
    }

    let bpe = match flavor {
        Some(flavor) => {
            let ranks = read_merges(md, &mut ids)?;
            let pre_tokenizer = PreTokenizer::new(flavor.patterns, flavor.byte_encode)
                .map_err(|problem| TokenizerError::BadPattern { pre: pre.into(), problem })?;
            Some(Bpe { pre: pre_tokenizer, flavor, ranks })
        }
        None => None,
    };

    let mut tok = Tokenizer {
        model: model.into(),
        pre: pre.into(),
        kind,
        bpe,
        texts,
        scores,
        // Set at the end; nothing below reads them through `tok` before then.
        attrs: Vec::new(),
        ids,
        hex_byte_tokens: [None; 256],
        ascii_tokens: [None; 128],
        specials: SpecialTokens::default(),
        eog: Vec::new(),
        special_order: Vec::new(),
        add_bos: false,
        add_eos: false,
        add_space_prefix: false,
        clean_spaces: false,
    };
    for b in 0..=255u8 {
        tok.hex_byte_tokens[b as usize] = tok.token_id(&format!("<0x{b:02X}>"));
        if b.is_ascii() {
            tok.ascii_tokens[b as usize] = tok.token_id(&(b as char).to_string());
        }
    }

    set_flags(&mut tok, md, flavor)?;
    tok.specials = read_special_ids(&tok, md, flavor)?;
    // The newline token, found the way llama.cpp does it: before special
    // tokens are in place, and without a fallback (its pad default is none).
    tok.specials.newline = match &tok.bpe {
        None => tok.byte_token(b'\n'),
        Some(bpe) => {
            let mut ids = Vec::new();
            bpe.encode(&tok, "\n", &mut ids)?;
            ids.first().copied()
        }
    };

    let mut specials = tok.specials;
    detect_special_ids(&tok, &mut specials, &mut attrs);
    tok.specials = specials;
    mark_unused(&tok, &mut attrs);
    tok.eog = end_of_generation(&tok, &mut attrs);
    tok.special_order = special_order(&tok, &attrs);
    apply_model_quirks(&tok, md, pre_key.unwrap_or(""), &mut attrs);
    tok.attrs = attrs;
    Ok(tok)
}

fn read_scores(md: &Metadata, n: usize) -> Result<Vec<f32>, TokenizerError> {
    let Some(array) = md.array(SCORES)? else {
        return Ok(vec![0.0; n]);
    };
    let scores: Vec<f32> = match array {
        Array::F32(v) => v.clone(),
        Array::I32(v) => v.iter().map(|&s| s as f32).collect(),
        other => return Err(wrong_elements(SCORES, other, "f32 or i32")),
    };
    if scores.len() != n {
        return Err(TokenizerError::LengthMismatch { key: SCORES, len: scores.len(), n_tokens: n });
    }
    // NaN has no order and -0.0 must equal 0.0 when merges compare scores.
    Ok(scores.into_iter().map(|s| if s.is_nan() { f32::NEG_INFINITY } else { s + 0.0 }).collect())
}

fn read_attrs(md: &Metadata, n: usize) -> Result<Vec<TokenAttr>, TokenizerError> {
    let Some(array) = md.array(TOKEN_TYPE)? else {
        return Ok(vec![TokenAttr::NORMAL; n]);
    };
    let types = array.to_i64s().ok_or_else(|| wrong_elements(TOKEN_TYPE, array, "integers"))?;
    if types.len() != n {
        return Err(TokenizerError::LengthMismatch { key: TOKEN_TYPE, len: types.len(), n_tokens: n });
    }
    // llama.cpp's `llama_token_type` values.
    Ok(types
        .into_iter()
        .map(|t| match t {
            1 => TokenAttr::NORMAL,
            2 => TokenAttr::UNKNOWN,
            3 => TokenAttr::CONTROL,
            4 => TokenAttr::USER_DEFINED,
            5 => TokenAttr::UNUSED,
            6 => TokenAttr::BYTE,
            _ => TokenAttr::default(),
        })
        .collect())
}

fn wrong_elements(key: &'static str, array: &Array, expected: &'static str) -> TokenizerError {
    TokenizerError::WrongElementType { key, found: array.element_type().name(), expected }
}

/// Merge ranks keyed by piece ids; pieces that are not tokens get ids after
/// the vocabulary. The first occurrence of a pair sets its rank.
fn read_merges(md: &Metadata, ids: &mut HashMap<Box<str>, u32>) -> Result<HashMap<(u32, u32), u32>, TokenizerError> {
    let merges = md.req_strings(MERGES)?;
    let mut next_id = ids.len() as u32;
    let mut intern = |piece: &str| -> Result<u32, TokenizerError> {
        if let Some(&id) = ids.get(piece) {
            return Ok(id);
        }
        if next_id >= u32::MAX - 1 {
            return Err(TokenizerError::VocabularyTooLarge(next_id as usize));
        }
        ids.insert(piece.into(), next_id);
        next_id += 1;
        Ok(next_id - 1)
    };
    let mut ranks = HashMap::with_capacity(merges.len());
    for (index, entry) in merges.iter().enumerate() {
        // llama.cpp splits at the first space after the first byte.
        let space = entry.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1);
        let Some(space) = space else {
            return Err(TokenizerError::BadMerge { index, entry: entry.clone() });
        };
        let left = intern(&entry[..space])?;
        let right = intern(&entry[space + 1..])?;
        let rank = u32::try_from(index).map_err(|_| TokenizerError::VocabularyTooLarge(index))?;
        ranks.entry((left, right)).or_insert(rank);
    }
    Ok(ranks)
}

fn set_flags(tok: &mut Tokenizer, md: &Metadata, flavor: Option<BpeFlavor>) -> Result<(), TokenizerError> {
    tok.add_space_prefix = tok.kind == TokenizerKind::Spm;
    tok.clean_spaces = flavor.is_some_and(|f| f.clean_spaces);
    tok.add_bos = flavor.is_none_or(|f| f.add_bos);
    tok.add_eos = false;
    if let Some(v) = md.bool("tokenizer.ggml.add_space_prefix")? {
        tok.add_space_prefix = v;
    }
    if let Some(v) = md.bool("tokenizer.ggml.add_bos_token")? {
        tok.add_bos = v;
    }
    if let Some(v) = md.bool("tokenizer.ggml.add_eos_token")? {
        tok.add_eos = v;
    }
    // llama.cpp always adds BOS for Gemma 4.
    if flavor.is_some_and(|f| f.gemma4) {
        tok.add_bos = true;
    }
    Ok(())
}

fn read_special_ids(
    tok: &Tokenizer,
    md: &Metadata,
    flavor: Option<BpeFlavor>,
) -> Result<SpecialTokens, TokenizerError> {
    let n = tok.texts.len();
    let default = |id: u32| ((id as usize) < n).then_some(id);
    let mut specials = SpecialTokens::default();
    match (tok.kind, tok.model.as_str()) {
        (TokenizerKind::Spm, _) => {
            specials.bos = default(1);
            specials.eos = default(2);
            specials.unk = default(0);
        }
        (TokenizerKind::Bpe, "gpt2") => {
            specials.bos = default(11).filter(|_| !flavor.is_some_and(|f| f.no_default_bos));
            specials.eos = default(11);
        }
        _ => {}
    }
    for (key, field) in ID_KEYS {
        if let Some(id) = md.u64(key)? {
            if id >= n as u64 {
                return Err(TokenizerError::BadTokenId { key, id, n_tokens: n });
            }
            *field(&mut specials) = Some(id as u32);
        }
    }
    Ok(specials)
}

/// Fills special ids the file leaves out by looking for their usual texts,
/// and marks what it finds as control tokens.
fn detect_special_ids(tok: &Tokenizer, specials: &mut SpecialTokens, attrs: &mut [TokenAttr]) {
    for (texts, field) in DETECTED {
        let slot = field(specials);
        if slot.is_some() {
            continue;
        }
        if let Some(id) = texts.iter().find_map(|t| tok.token_id(t)) {
            *slot = Some(id);
            attrs[id as usize] = attrs[id as usize] | TokenAttr::CONTROL;
        }
    }
}

/// Control tokens whose text says "unused" are marked unused.
fn mark_unused(tok: &Tokenizer, attrs: &mut [TokenAttr]) {
    for (attr, text) in attrs.iter_mut().zip(&tok.texts) {
        if attr.any(TokenAttr::CONTROL) && text.contains("unused") {
            *attr = *attr | TokenAttr::UNUSED;
        }
    }
}

/// llama.cpp's end-of-generation set, with its attribute corrections.
fn end_of_generation(tok: &Tokenizer, attrs: &mut [TokenAttr]) -> Vec<u32> {
    let s = &tok.specials;
    let mut eog: BTreeSet<u32> = [s.fim_pad, s.fim_rep, s.fim_sep].into_iter().flatten().collect();
    for id in EOG_TEXTS.iter().filter_map(|t| tok.token_id(t)) {
        eog.insert(id);
        attrs[id as usize] = attrs[id as usize] | TokenAttr::CONTROL;
    }
    // gpt-oss: these are always rendered.
    for id in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"].iter().filter_map(|t| tok.token_id(t)) {
        attrs[id as usize] = TokenAttr::USER_DEFINED;
    }
    eog.extend([s.eos, s.eot, s.eom].into_iter().flatten());

    let in_eog = |eog: &BTreeSet<u32>, text: &str| tok.token_id(text).filter(|id| eog.contains(id));
    // With "<|return|>" and "<|call|>" (o200k_harmony), or "<|calls|>" and
    // "<|flush|>" (solar-open), "<|end|>" does not end generation.
    let has_call = in_eog(&eog, "<|call|>").is_some() || in_eog(&eog, "<|calls|>").is_some();
    let ends_early = has_call && (in_eog(&eog, "<|return|>").is_some() || in_eog(&eog, "<|flush|>").is_some());
    if let Some(end) = in_eog(&eog, "<|end|>").filter(|_| ends_early) {
        eog.remove(&end);
        attrs[end as usize] = TokenAttr::USER_DEFINED;
    }
    // Gemma 4 and PLaMo have a normal "</s>".
    let normal_s = in_eog(&eog, "<|tool_response>").is_some() || in_eog(&eog, "<|plamo:eos|>").is_some();
    if let Some(s_id) = in_eog(&eog, "</s>").filter(|_| normal_s) {
        eog.remove(&s_id);
        attrs[s_id as usize] = TokenAttr::NORMAL;
    }
    eog.into_iter().collect()
}

/// Control, user-defined and unknown tokens, longest text first (ties by id).
fn special_order(tok: &Tokenizer, attrs: &[TokenAttr]) -> Vec<u32> {
    let special = TokenAttr::CONTROL | TokenAttr::USER_DEFINED | TokenAttr::UNKNOWN;
    let mut order: Vec<u32> = (0..attrs.len() as u32).filter(|&id| attrs[id as usize].any(special)).collect();
    order.sort_by_key(|&id| std::cmp::Reverse(tok.texts[id as usize].len()));
    order
}

/// Per-model strip attributes llama.cpp sets by model name, pre-tokenizer or
/// architecture.
fn apply_model_quirks(tok: &Tokenizer, md: &Metadata, raw_pre: &str, attrs: &mut [TokenAttr]) {
    let text_of = |key: &str| md.get(key).and_then(|v| v.as_str()).unwrap_or("");
    let name = text_of("general.name").to_ascii_lowercase();
    let arch = text_of("general.architecture");
    let set = |attrs: &mut [TokenAttr], text: &str, bit: TokenAttr, on: bool| {
        if let Some(id) = tok.token_id(text) {
            let a = &mut attrs[id as usize];
            *a = if on { *a | bit } else { TokenAttr(a.0 & !bit.0) };
        }
    };
    if ["jina-v2-de", "jina-v2-es", "jina-v2-code"].iter().any(|p| raw_pre.contains(p))
        || ["nomic-bert-moe", "jina-bert-v3"].iter().any(|a| arch.contains(a))
    {
        set(attrs, "<mask>", TokenAttr::LSTRIP, true);
    } else if name.contains("phi-3") || name.contains("phi3") {
        for &id in &tok.special_order {
            attrs[id as usize] = attrs[id as usize] | TokenAttr::RSTRIP;
        }
        set(attrs, "</s>", TokenAttr::RSTRIP, true);
        for text in ["<unk>", "<s>", "<|endoftext|>"] {
            set(attrs, text, TokenAttr::RSTRIP, false);
        }
    } else if name.contains("modern-bert") {
        set(attrs, "[MASK]", TokenAttr::LSTRIP, true);
    }
}

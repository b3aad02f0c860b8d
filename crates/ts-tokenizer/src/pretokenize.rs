//! Pre-tokenizers: how BPE text is cut into words before merges run.
//!
//! Each `tokenizer.ggml.pre` name maps to the list of split patterns that
//! llama.cpp's `llm_tokenizer_bpe` uses for it (`src/llama-vocab.cpp`), applied
//! one after another, each cutting the pieces the previous one left. Like
//! llama.cpp (`src/unicode.cpp`), five patterns run through hand-written
//! splitters and the others through a regex engine that sees the text the way
//! llama.cpp's `std::regex` fallback does: for a pattern that uses `\p{..}`,
//! every non-ASCII code point is first replaced by one stand-in character per
//! Unicode class and `\p{..}` by a class of that stand-in plus the ASCII
//! members; otherwise only non-ASCII whitespace is replaced by `\x0B`.

use crate::TokenizerError;
use crate::unicode::{ByteMap, CharInfo, Class, class_of};

const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const NEWLINES: &str = r"[^\n]+|[\n]+";

const DIGIT: &str = r"\p{N}";
const DIGITS: &str = r"\p{N}+";
const DIGITS_1_3: &str = r"\p{N}{1,3}";
const PORO: &str = " ?[^(\\s|.,!?\u{2026}\u{3002}\u{FF0C}\u{3001}\u{964}\u{6D4}\u{60C})]+";
const CJK_KANA: &str = "[\u{4E00}-\u{9FA5}\u{3040}-\u{309F}\u{30A0}-\u{30FF}]+";
const CJK_HANGUL: &str = "[\u{4E00}-\u{9FA5}\u{800}-\u{4E00}\u{AC00}-\u{D7FF}]+";

const DEFAULT: &[&str] = &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, DIGITS, r"[0-9][0-9][0-9]"];
const FALCON: &[&str] = &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"];
const STARCODER: &[&str] = &[DIGIT, GPT2];
const JAIS2: &[&str] = &[
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",
];
const DEEPSEEK_LLM: &[&str] = &[
    "[\r\n]",
    "\\s?[A-Za-z\u{B5}\u{C0}-\u{D6}\u{D8}-\u{F6}\u{F8}-\u{1BA}\u{1BC}-\u{1BF}\u{1C4}-\u{293}\u{295}-\u{2AF}\u{370}-\u{373}\u{376}\u{377}\u{37B}-\u{37D}\u{37F}\u{386}\u{388}-\u{38A}\u{38C}\u{38E}-\u{3A1}\u{3A3}-\u{3F5}\u{3F7}-\u{481}\u{48A}-\u{52F}\u{531}-\u{556}\u{10A0}-\u{10C5}\u{13A0}-\u{13F5}\u{13F8}-\u{13FD}\u{1C90}-\u{1CBA}\u{1CBD}-\u{1CBF}\u{1D00}-\u{1D2B}\u{1D6B}-\u{1D77}\u{1D79}-\u{1D9A}\u{1E00}-\u{1F15}\u{1F18}-\u{1F1D}\u{1F20}-\u{1F45}\u{1F48}-\u{1F4D}\u{1F50}-\u{1F57}\u{1F59}\u{1F5B}\u{1F5D}\u{1F5F}-\u{1F7D}\u{1F80}-\u{1FB4}\u{1FB6}-\u{1FBC}\u{1FBE}\u{1FC2}-\u{1FC4}\u{1FC6}-\u{1FCC}\u{1FD0}-\u{1FD3}\u{1FD6}-\u{1FDB}\u{1FE0}-\u{1FEC}\u{1FF2}-\u{1FF4}\u{1FF6}-\u{1FFC}\u{2102}\u{2107}\u{210A}-\u{2113}\u{2115}\u{2119}-\u{211D}\u{2124}\u{2126}\u{2128}\u{212A}-\u{212D}\u{212F}-\u{2134}\u{2139}\u{213C}-\u{213F}\u{2145}-\u{2149}\u{214E}\u{2183}\u{2184}\u{2C00}-\u{2C7B}\u{2C7E}-\u{2CE4}\u{2CEB}-\u{2CEE}\u{2CF2}\u{2CF3}\u{A640}-\u{A66D}\u{A680}-\u{A69B}\u{A722}-\u{A76F}\u{A771}-\u{A787}\u{A78B}-\u{A78E}\u{AB70}-\u{ABBF}\u{FB00}-\u{FB06}\u{FB13}-\u{FB17}\u{FF21}-\u{FF3A}\u{FF41}-\u{FF5A}\u{10400}-\u{1044F}\u{104B0}-\u{104D3}\u{104D8}-\u{104FB}\u{10C80}-\u{10CB2}\u{10CC0}-\u{10CF2}\u{118A0}-\u{118DF}\u{1E900}-\u{1E943}]+",
    "\\s?[!-/:-~\u{FF01}-\u{FF0F}\u{FF1A}-\u{FF5E}\u{2018}-\u{201F}\u{3000}-\u{3002}]+",
    r"\s+$",
    CJK_HANGUL,
    DIGITS,
];
const DEEPSEEK_CODER: &[&str] = &["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK_HANGUL, DIGIT];
const DEEPSEEK3: &[&str] = &[
    DIGITS_1_3,
    CJK_KANA,
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
];
const SPARK2_5: &[&str] = &[
    DIGITS_1_3,
    CJK_KANA,
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+",
    DIGIT,
];
const YOUTU: &[&str] = &[
    "[\u{AC00}-\u{D7A3}\u{3131}-\u{318E}]+|[\u{FF01}\u{2026}\u{201C}\u{201D}\u{2018}\u{2019}\u{2014}\u{FF1A}\u{FF1B}\u{FF0C}\u{3001}-\u{303F}\u{FE30}-\u{FE4F}]+|[\u{3105}-\u{312F}]+|[\u{4E00}-\u{9FA5}\u{3040}-\u{309F}\u{30A0}-\u{30FF}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];
const TEKKEN: &[&str] = &[
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];
const CHAMELEON: &[&str] = &[
    r"<sentinel:[0-9]+>",
    r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
    r"([\t\n]|    |  )",
    DIGIT,
    r"[\p{P}!-/:-@\[-`{-~]",
    GPT2,
];
const GPT4O: &[&str] = &[
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];
const GRANITE_EMB_MULTI: &[&str] = &[
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];
const BAILINGMOE: &[&str] = &[
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
];
const SEED_CODER: &[&str] = &[
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
];
const UFAKZEKA: &[&str] = &[r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"];
const EXAONE_MOE: &[&str] = &[
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
];
const MINICPM5: &[&str] = &[
    DIGITS_1_3,
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];

/// Everything a `tokenizer.ggml.pre` name decides, with llama.cpp's defaults
/// for BPE vocabularies (`llama_vocab::impl::load`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct BpeFlavor {
    pub patterns: &'static [&'static str],
    /// Words are mapped through GPT-2's byte-to-character table before merging.
    pub byte_encode: bool,
    /// Spaces become U+2581 before splitting (SentencePiece-style BPE).
    pub escape_whitespaces: bool,
    pub clean_spaces: bool,
    /// A word that is itself a token is emitted whole, without merging.
    pub ignore_merges: bool,
    pub add_bos: bool,
    /// The pre-type clears the default BOS id.
    pub no_default_bos: bool,
    /// Gemma 4's pre-type: BOS is always added, and a run of newlines that
    /// is a token is emitted whole.
    pub gemma4: bool,
}

impl BpeFlavor {
    fn new(patterns: &'static [&'static str]) -> BpeFlavor {
        BpeFlavor {
            patterns,
            byte_encode: true,
            escape_whitespaces: false,
            clean_spaces: true,
            ignore_merges: false,
            add_bos: false,
            no_default_bos: false,
            gemma4: false,
        }
    }
    fn keep_spaces(mut self) -> Self {
        self.clean_spaces = false;
        self
    }
    fn ignore_merges(mut self) -> Self {
        self.ignore_merges = true;
        self
    }
    fn add_bos(mut self) -> Self {
        self.add_bos = true;
        self
    }
    fn spm_style(mut self) -> Self {
        self.byte_encode = false;
        self.escape_whitespaces = true;
        self
    }
}

/// The flavor for a BPE `tokenizer.ggml.pre` value, or `None` if unsupported.
/// Names and flags follow llama.cpp's `llama_vocab::impl::load`.
pub(crate) fn bpe_flavor(pre: &str) -> Option<BpeFlavor> {
    let f = BpeFlavor::new;
    Some(match pre {
        "default" => f(DEFAULT),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2"
        | "jina-v5-nano" => f(&[LLAMA3]).ignore_merges().add_bos(),
        "deepseek-llm" => f(DEEPSEEK_LLM).keep_spaces(),
        "deepseek-coder" => f(DEEPSEEK_CODER).keep_spaces(),
        "deepseek-v3" | "hunyuan-dense" | "hy_v4" | "joyai-llm" => f(DEEPSEEK3).keep_spaces(),
        "spark2_5" => f(SPARK2_5).keep_spaces(),
        "youtu" => f(YOUTU).keep_spaces().ignore_merges(),
        "falcon" => f(FALCON),
        "mpt" | "olmo" | "jais" | "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es"
        | "jina-v2-de" | "a.x-4.0" | "mellum" | "modern-bert" | "exaone4" | "jina-v1-en" | "jina-v2-code"
        | "roberta-bpe" => f(&[GPT2]),
        "trillion" | "granite-docling" => f(&[GPT2]).keep_spaces(),
        "jais-2" => f(JAIS2),
        "gemma4" | "granite-embed-multi-311m" => BpeFlavor { gemma4: true, ..f(&[NEWLINES]).spm_style() },
        "sarvam-moe" => f(&[NEWLINES]).spm_style().keep_spaces(),
        "starcoder" | "refact" | "codeshell" | "exaone" | "minerva-7b" | "mellum2" => f(STARCODER),
        "command-r" | "smollm" => f(STARCODER).keep_spaces(),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "hunyuan" | "solar-open" | "grok-2" => {
            f(&[QWEN2]).keep_spaces()
        }
        "stablelm2" | "megrez" => f(&[QWEN2]),
        "qwen35" => f(&[QWEN35]).keep_spaces(),
        "dbrx" | "smaug-bpe" => f(&[LLAMA3]),
        "poro-chat" => f(&[PORO]).keep_spaces(),
        "bloom" | "gpt3-finnish" => f(&[PORO]),
        "viking" => f(&[PORO, DIGIT]).keep_spaces(),
        "chatglm-bpe" => BpeFlavor { no_default_bos: true, ..f(&[LLAMA3]) },
        "glm4" | "glm5" => BpeFlavor { no_default_bos: true, ..f(&[LLAMA3]).ignore_merges() },
        "tekken" => f(TEKKEN).keep_spaces().ignore_merges().add_bos(),
        "chameleon" => f(CHAMELEON).keep_spaces().add_bos(),
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => f(GPT4O).keep_spaces(),
        "granite-embed-multi-97m" => f(GRANITE_EMB_MULTI).keep_spaces().ignore_merges(),
        "bailingmoe" | "bailingmoe2" | "llada-moe" => f(BAILINGMOE).keep_spaces(),
        "seed-coder" => f(SEED_CODER).keep_spaces(),
        "ufakzeka" => f(UFAKZEKA).keep_spaces(),
        "laguna" => f(&[NEWLINES, QWEN2]).keep_spaces(),
        "exaone-moe" => f(EXAONE_MOE).keep_spaces(),
        "minicpm5" => f(MINICPM5).ignore_merges(),
        _ => return None,
    })
}

/// One split pass.
enum Splitter {
    Gpt2,
    /// The llama3 / qwen2 / qwen35 family: digits in runs of at most
    /// `max_digits`, and whether combining marks join letter runs.
    LlamaFamily {
        max_digits: usize,
        marks_join_letters: bool,
    },
    Newlines,
    Regex {
        regex: Box<fancy_regex::Regex>,
        collapsed: bool,
    },
}

/// A compiled pre-tokenizer.
pub(crate) struct PreTokenizer {
    splitters: Vec<Splitter>,
    byte_encode: bool,
}

impl std::fmt::Debug for PreTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreTokenizer").field("passes", &self.splitters.len()).finish()
    }
}

/// Backtracking budget per regex search; the supported patterns are linear,
/// so only hostile input comes near it.
const BACKTRACK_LIMIT: usize = 50_000_000;

impl PreTokenizer {
    pub fn new(patterns: &[&str], byte_encode: bool) -> Result<PreTokenizer, String> {
        let splitters = patterns.iter().map(|p| Splitter::compile(p)).collect::<Result<_, _>>()?;
        Ok(PreTokenizer { splitters, byte_encode })
    }

    /// Splits `text` into words; with byte encoding each byte of a word becomes
    /// its GPT-2 character.
    pub fn split(&self, text: &str) -> Result<Vec<String>, TokenizerError> {
        let chars: Vec<char> = text.chars().collect();
        if chars.is_empty() {
            return Ok(Vec::new());
        }
        let mut lengths = vec![chars.len()];
        for splitter in &self.splitters {
            lengths = splitter.split(&chars, &lengths)?;
        }
        let byte_map = ByteMap::get();
        let mut words = Vec::with_capacity(lengths.len());
        let mut start = 0;
        let mut utf8 = [0u8; 4];
        for len in lengths {
            let piece = &chars[start..start + len];
            start += len;
            let mut word = String::with_capacity(len * 2);
            for &c in piece {
                if self.byte_encode {
                    for &b in c.encode_utf8(&mut utf8).as_bytes() {
                        word.push(byte_map.to_char[b as usize]);
                    }
                } else {
                    word.push(c);
                }
            }
            words.push(word);
        }
        Ok(words)
    }
}

impl Splitter {
    fn compile(pattern: &str) -> Result<Splitter, String> {
        Ok(match pattern {
            GPT2 => Splitter::Gpt2,
            LLAMA3 => Splitter::LlamaFamily { max_digits: 3, marks_join_letters: false },
            QWEN2 => Splitter::LlamaFamily { max_digits: 1, marks_join_letters: false },
            QWEN35 => Splitter::LlamaFamily { max_digits: 1, marks_join_letters: true },
            NEWLINES => Splitter::Newlines,
            _ => {
                let collapsed = uses_categories(pattern);
                let translated = if collapsed { collapse_pattern(pattern)? } else { pattern.to_string() };
                let translated = ascii_shorthands(&translated);
                let regex = fancy_regex::RegexBuilder::new(&translated)
                    .backtrack_limit(BACKTRACK_LIMIT)
                    .build()
                    .map_err(|e| format!("pattern {pattern:?} does not compile: {e}"))?;
                Splitter::Regex { regex: Box::new(regex), collapsed }
            }
        })
    }

    /// Cuts each piece (given as lengths in chars) of `chars` further.
    fn split(&self, chars: &[char], lengths: &[usize]) -> Result<Vec<usize>, TokenizerError> {
        let mut out = Vec::with_capacity(lengths.len() * 2);
        let mut start = 0;
        for &len in lengths {
            let piece = &chars[start..start + len];
            start += len;
            match self {
                Splitter::Gpt2 => split_gpt2(piece, &mut out),
                Splitter::LlamaFamily { max_digits, marks_join_letters } => {
                    split_llama_family(piece, *max_digits, *marks_join_letters, &mut out)
                }
                Splitter::Newlines => split_newlines(piece, &mut out),
                Splitter::Regex { regex, collapsed } => split_regex(regex, *collapsed, piece, &mut out)?,
            }
        }
        Ok(out)
    }
}

/// Records word boundaries inside one piece.
struct Cuts<'a> {
    out: &'a mut Vec<usize>,
    last: usize,
}

impl Cuts<'_> {
    fn cut(&mut self, end: usize) {
        if end > self.last {
            self.out.push(end - self.last);
        }
        self.last = end;
    }
}

fn info_at(piece: &[char], pos: usize) -> Option<CharInfo> {
    piece.get(pos).map(|&c| CharInfo::of(c))
}

fn char_at(piece: &[char], pos: usize) -> Option<char> {
    piece.get(pos).copied()
}

/// Length of an English contraction (`'s`, `'t`, `'re`, `'ve`, `'m`, `'ll`,
/// `'d`) starting at `pos`, optionally ignoring ASCII case.
fn contraction_len(piece: &[char], pos: usize, any_case: bool) -> Option<usize> {
    if piece[pos] != '\'' {
        return None;
    }
    let fold = |c: Option<char>| c.map(|c| if any_case { c.to_ascii_lowercase() } else { c });
    let next = fold(char_at(piece, pos + 1))?;
    if matches!(next, 's' | 't' | 'm' | 'd') {
        return Some(2);
    }
    let after = fold(char_at(piece, pos + 2))?;
    matches!((next, after), ('r', 'e') | ('v', 'e') | ('l', 'l')).then_some(3)
}

/// A whitespace run at `pos`: `\s+(?!\S)` leaves the last whitespace before a
/// non-space for the next word; at the end of the piece it takes the whole run.
fn whitespace_run_end(piece: &[char], pos: usize) -> Option<usize> {
    let n = piece[pos..].iter().take_while(|&&c| crate::unicode::is_whitespace(c)).count();
    match n {
        0 => None,
        1 => Some(pos + 1),
        _ if pos + n < piece.len() => Some(pos + n - 1),
        _ => Some(pos + n),
    }
}

/// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)`
/// as llama.cpp's `unicode_regex_split_custom_gpt2` evaluates it.
fn split_gpt2(piece: &[char], out: &mut Vec<usize>) {
    let mut cuts = Cuts { out, last: 0 };
    let mut pos = 0;
    while pos < piece.len() {
        if let Some(n) = contraction_len(piece, pos, false) {
            pos += n;
            cuts.cut(pos);
            continue;
        }
        let c = piece[pos];
        let lead = if c == ' ' { info_at(piece, pos + 1) } else { info_at(piece, pos) };
        if let Some(lead) = lead {
            let run: Option<fn(CharInfo) -> bool> = if lead.is_letter() {
                Some(CharInfo::is_letter)
            } else if lead.is_number() {
                Some(CharInfo::is_number)
            } else if !(lead.whitespace || lead.is_letter() || lead.is_number()) {
                Some(|i: CharInfo| !(i.whitespace || i.is_letter() || i.is_number()))
            } else {
                None
            };
            if let Some(in_run) = run {
                pos += usize::from(c == ' ');
                while info_at(piece, pos).is_some_and(in_run) {
                    pos += 1;
                }
                cuts.cut(pos);
                continue;
            }
        }
        pos = whitespace_run_end(piece, pos).unwrap_or(pos + 1);
        cuts.cut(pos);
    }
}

/// The llama3 pattern (and qwen2's, with single digits, and qwen35's, where
/// marks join letters), as llama.cpp's custom splitters evaluate them:
/// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
/// ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`.
fn split_llama_family(piece: &[char], max_digits: usize, marks_join_letters: bool, out: &mut Vec<usize>) {
    let in_word = |i: CharInfo| i.is_letter() || (marks_join_letters && i.is_mark());
    let in_symbols =
        |i: CharInfo| !(i.whitespace || i.is_letter() || i.is_number() || (marks_join_letters && i.is_mark()));
    let is_newline = |c: Option<char>| matches!(c, Some('\r' | '\n'));
    let mut cuts = Cuts { out, last: 0 };
    let mut pos = 0;
    while pos < piece.len() {
        if let Some(n) = contraction_len(piece, pos, true) {
            pos += n;
            cuts.cut(pos);
            continue;
        }
        let c = piece[pos];
        let info = CharInfo::of(c);
        // [^\r\n\p{L}\p{N}]?\p{L}+
        if !(c == '\r' || c == '\n' || info.is_number())
            && (in_word(info) || info_at(piece, pos + 1).is_some_and(in_word))
        {
            pos += 1;
            while info_at(piece, pos).is_some_and(in_word) {
                pos += 1;
            }
            cuts.cut(pos);
            continue;
        }
        // \p{N}{1,max_digits}
        if info.is_number() {
            let mut run_start = pos;
            while info_at(piece, pos).is_some_and(CharInfo::is_number) {
                pos += 1;
                if pos - run_start >= max_digits {
                    cuts.cut(pos);
                    run_start = pos;
                }
            }
            cuts.cut(pos);
            continue;
        }
        // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
        let lead = if c == ' ' { info_at(piece, pos + 1) } else { Some(info) };
        if lead.is_some_and(in_symbols) {
            pos += usize::from(c == ' ');
            while info_at(piece, pos).is_some_and(in_symbols) {
                pos += 1;
            }
            while is_newline(char_at(piece, pos)) {
                pos += 1;
            }
            cuts.cut(pos);
            continue;
        }
        // \s*[\r\n]+ takes the run up to its last newline.
        let run = piece[pos..].iter().take_while(|&&c| crate::unicode::is_whitespace(c));
        if let Some(last_newline) = run.enumerate().filter(|(_, c)| matches!(c, '\r' | '\n')).map(|(i, _)| i).last() {
            pos += last_newline + 1;
            cuts.cut(pos);
            continue;
        }
        pos = whitespace_run_end(piece, pos).unwrap_or(pos + 1);
        cuts.cut(pos);
    }
}

/// `[^\n]+|[\n]+`: runs of newlines and runs of everything else.
fn split_newlines(piece: &[char], out: &mut Vec<usize>) {
    let mut pos = 0;
    while pos < piece.len() {
        let newline = piece[pos] == '\n';
        let run = piece[pos..].iter().take_while(|&&c| (c == '\n') == newline).count();
        out.push(run);
        pos += run;
    }
}

/// Matches of the regex become words, and so do the gaps between them.
fn split_regex(
    regex: &fancy_regex::Regex,
    collapsed: bool,
    piece: &[char],
    out: &mut Vec<usize>,
) -> Result<(), TokenizerError> {
    let text: String = piece.iter().map(|&c| if collapsed { collapse_char(c) } else { plain_char(c) }).collect();
    // Byte offset of each char of `text`, to turn match offsets into char counts.
    let mut char_starts: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
    char_starts.push(text.len());
    let to_chars = |byte: usize| char_starts.partition_point(|&b| b < byte);
    let mut done = 0;
    for m in regex.find_iter(&text) {
        let m = m.map_err(|e| TokenizerError::PreTokenizer(e.to_string()))?;
        let (start, end) = (to_chars(m.start()), to_chars(m.end()));
        if start > done {
            out.push(start - done);
        }
        if end > start {
            out.push(end - start);
        }
        done = end;
    }
    if piece.len() > done {
        out.push(piece.len() - done);
    }
    Ok(())
}

/// Stand-in characters for non-ASCII code points in collapsed text.
fn class_stand_in(class: Class) -> char {
    match class {
        Class::Number => '\u{D1}',
        Class::Letter => '\u{D2}',
        Class::Punctuation => '\u{D3}',
        Class::Mark => '\u{D4}',
        Class::Symbol => '\u{D5}',
        Class::Unassigned | Class::Separator | Class::Control => '\u{D0}',
    }
}

fn collapse_char(c: char) -> char {
    if c.is_ascii() {
        c
    } else if crate::unicode::is_whitespace(c) {
        '\u{0B}'
    } else {
        class_stand_in(class_of(c))
    }
}

fn plain_char(c: char) -> char {
    if !c.is_ascii() && crate::unicode::is_whitespace(c) { '\u{0B}' } else { c }
}

/// The `\p{..}` names llama.cpp collapses, and the class each stands for.
fn category_class(name: &str) -> Option<Class> {
    Some(match name {
        "N" => Class::Number,
        "L" | "Lu" | "Ll" | "Lt" | "Lm" | "Lo" => Class::Letter,
        "P" => Class::Punctuation,
        "M" => Class::Mark,
        "S" => Class::Symbol,
        _ => return None,
    })
}

fn uses_categories(pattern: &str) -> bool {
    ["N", "L", "P", "M", "S", "Lu", "Ll", "Lt", "Lm", "Lo"].iter().any(|n| pattern.contains(&format!("\\p{{{n}}}")))
}

/// The members of a class in collapsed text: its stand-in and its ASCII code points.
fn class_members(class: Class) -> String {
    let mut s = format!("\\x{{{:X}}}", class_stand_in(class) as u32);
    for b in 0u8..128 {
        if class_of(b as char) == class {
            s.push_str(&format!("\\x{{{b:02X}}}"));
        }
    }
    s
}

/// Rewrites `\p{X}` for collapsed text: inside a bracket expression it adds
/// the members, outside it becomes a bracket expression of them. Brackets are
/// tracked the way llama.cpp does (a bracket preceded by a backslash is literal).
fn collapse_pattern(pattern: &str) -> Result<String, String> {
    if !pattern.is_ascii() {
        return Err(format!("pattern {pattern:?} mixes Unicode classes and non-ASCII characters"));
    }
    let bytes = pattern.as_bytes();
    let mut out = String::with_capacity(pattern.len() * 4);
    let mut inside = false;
    let mut i = 0;
    while i < bytes.len() {
        let escaped = i > 0 && bytes[i - 1] == b'\\';
        match bytes[i] {
            b'[' if !escaped => inside = true,
            b']' if inside && !escaped => inside = false,
            b'\\' if pattern[i..].starts_with("\\p{") => {
                let close = pattern[i..].find('}').map(|c| i + c);
                if let Some(class) = close.and_then(|c| category_class(&pattern[i + 3..c])) {
                    let members = class_members(class);
                    if inside {
                        out.push_str(&members);
                    } else {
                        out.push('[');
                        out.push_str(&members);
                        out.push(']');
                    }
                    i = close.unwrap_or(i) + 1;
                    continue;
                }
                return Err(format!("pattern {pattern:?} uses an unsupported Unicode class"));
            }
            _ => {}
        }
        out.push(bytes[i] as char);
        i += 1;
    }
    Ok(out)
}

/// `\d` and `\w` mean ASCII digits and word characters in llama.cpp's
/// `std::regex`, but all of Unicode's in Rust's regex.
fn ascii_shorthands(pattern: &str) -> String {
    let mut out = String::with_capacity(pattern.len());
    let mut chars = pattern.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str("[0-9]"),
            Some('D') => out.push_str("[^0-9]"),
            Some('w') => out.push_str("[0-9A-Za-z_]"),
            Some('W') => out.push_str("[^0-9A-Za-z_]"),
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => out.push('\\'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(patterns: &[&str], text: &str) -> Vec<String> {
        PreTokenizer::new(patterns, false).unwrap().split(text).unwrap()
    }

    #[test]
    fn every_supported_flavor_compiles() {
        let names = [
            "default",
            "llama-bpe",
            "deepseek-llm",
            "deepseek-coder",
            "deepseek-v3",
            "spark2_5",
            "youtu",
            "falcon",
            "gpt-2",
            "trillion",
            "jais-2",
            "gemma4",
            "sarvam-moe",
            "starcoder",
            "smollm",
            "qwen2",
            "stablelm2",
            "qwen35",
            "dbrx",
            "poro-chat",
            "bloom",
            "viking",
            "chatglm-bpe",
            "glm4",
            "tekken",
            "chameleon",
            "gpt-4o",
            "granite-embed-multi-97m",
            "bailingmoe",
            "seed-coder",
            "ufakzeka",
            "laguna",
            "exaone-moe",
            "minicpm5",
        ];
        for name in names {
            let flavor = bpe_flavor(name).unwrap();
            PreTokenizer::new(flavor.patterns, flavor.byte_encode).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        assert!(bpe_flavor("kimi-k2").is_none());
    }

    #[test]
    fn gpt2_splits() {
        assert_eq!(
            words(&[GPT2], "Hello world's  end 123!!\n\n x"),
            ["Hello", " world", "'s", " ", " end", " 123", "!!", "\n\n", " x"]
        );
    }

    #[test]
    fn llama3_splits() {
        assert_eq!(
            words(&[LLAMA3], "I'M 12345 ab\n\n  cd  "),
            ["I", "'M", " ", "123", "45", " ab", "\n\n", " ", " cd", "  "]
        );
    }

    #[test]
    fn regex_collapsed() {
        assert_eq!(words(&[DIGIT, GPT2], "a1٣ b"), ["a", "1", "٣", " b"]);
        assert_eq!(words(GPT4O, "HelloWorld ÉTÉ été"), ["Hello", "World", " ÉTÉ", " été"]);
    }

    #[test]
    fn pattern_translation() {
        assert_eq!(
            collapse_pattern(r"\p{N}").unwrap(),
            r"[\x{D1}\x{30}\x{31}\x{32}\x{33}\x{34}\x{35}\x{36}\x{37}\x{38}\x{39}]"
        );
        assert!(collapse_pattern(r"\p{Han}+").is_err());
        assert_eq!(ascii_shorthands(r"\d\\d\w"), r"[0-9]\\d[0-9A-Za-z_]");
    }
}

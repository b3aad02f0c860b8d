/// Everything that can go wrong building a tokenizer or using it.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Metadata(#[from] ts_gguf::GgufError),
    #[error("tokenizer model '{0}' is not supported")]
    UnsupportedModel(String),
    #[error("pre-tokenizer '{0}' is not supported")]
    UnsupportedPreTokenizer(String),
    #[error("metadata 'tokenizer.ggml.tokens' is empty")]
    EmptyVocabulary,
    #[error("metadata 'tokenizer.ggml.tokens' has {0} entries, more than token ids can address")]
    VocabularyTooLarge(usize),
    #[error("metadata 'tokenizer.ggml.tokens' has the text {text:?} at ids {first} and {second}")]
    DuplicateToken { text: String, first: u32, second: u32 },
    #[error("metadata '{key}' has {len} entries, but 'tokenizer.ggml.tokens' has {n_tokens}")]
    LengthMismatch { key: &'static str, len: usize, n_tokens: usize },
    #[error("metadata '{key}' is an array of {found}, expected {expected}")]
    WrongElementType { key: &'static str, found: &'static str, expected: &'static str },
    #[error("metadata '{key}' = {id} is not a token id (the vocabulary has {n_tokens} tokens)")]
    BadTokenId { key: &'static str, id: u64, n_tokens: usize },
    #[error("metadata 'tokenizer.ggml.merges' entry {index} ({entry:?}) is not two pieces separated by a space")]
    BadMerge { index: usize, entry: String },
    #[error("pre-tokenizer '{pre}': {problem}")]
    BadPattern { pre: String, problem: String },
    #[error("pre-tokenizer failed on the input: {0}")]
    PreTokenizer(String),
    #[error("token id {id} is out of range (the vocabulary has {n_tokens} tokens)")]
    TokenOutOfRange { id: u32, n_tokens: usize },
    #[error("the model adds a {0} token, but the vocabulary defines none")]
    MissingSpecialToken(&'static str),
    #[error("the text needs byte 0x{0:02X}, but the vocabulary has no token for it")]
    MissingByteToken(u8),
}

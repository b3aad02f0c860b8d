//! The real models a synthetic file imitates: hyperparameters from each model's
//! Hugging Face `config.json`, tensor types from the GGUF recipe its public files use.

use crate::SynthError;

/// The architectures written, by their llama.cpp graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `gpt-oss`: sliding window on even layers, attention sinks, biases, YaRN.
    GptOss,
    /// `qwen3moe`: per-head q/k norms, no biases.
    Qwen3Moe,
    /// `llama` with experts (Mixtral).
    Mixtral,
}

impl Family {
    /// `general.architecture`.
    pub fn gguf_arch(self) -> &'static str {
        match self {
            Family::GptOss => "gpt-oss",
            Family::Qwen3Moe => "qwen3moe",
            Family::Mixtral => "llama",
        }
    }
}

/// How the public GGUF types its tensors (llama-quantize's rules, `src/llama-quant.cpp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recipe {
    /// `MXFP4_MOE` (ggml-org's gpt-oss files): experts MXFP4, other matrices Q8_0, vectors F32.
    Mxfp4Moe,
    /// `Q4_K_M`: Q4_K, with Q6_K for the output, for `attn_v` and `ffn_down(_exps)` in the
    /// layers `use_more_bits` picks, and Q8_0/Q5_K attention when there are 8 experts.
    Q4KM,
}

/// A published GGUF of the model, to compare sizes with.
#[derive(Clone, Copy, Debug)]
pub struct Reference {
    pub file: &'static str,
    /// Size as published (decimal GB × 1e9, so only to the precision shown).
    pub bytes: u64,
    pub source: &'static str,
}

/// Everything needed to lay out a model's GGUF.
#[derive(Clone, Debug)]
pub struct ModelSpec {
    pub name: &'static str,
    pub family: Family,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    /// `feed_forward_length` as the converter writes it (HF `intermediate_size`).
    pub n_ff: usize,
    /// Hidden width of one routed expert.
    pub n_ff_exp: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub rope_freq_base: f32,
    pub rms_eps: f32,
    /// YaRN `(factor, original context)`.
    pub yarn: Option<(f32, usize)>,
    pub sliding_window: Option<usize>,
    pub recipe: Recipe,
    /// Exponent θ of the expert popularity law `rank^-θ` in skewed routing (docs/SYNTH.md).
    pub routing_skew: f32,
    pub reference: Reference,
}

/// The names `spec` knows.
pub const NAMES: [&str; 5] = ["gpt-oss-20b", "gpt-oss-120b", "qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b"];

/// The model called `name` (see [`NAMES`]).
pub fn spec(name: &str) -> Result<ModelSpec, SynthError> {
    let gpt_oss = |name, n_layer, n_expert, routing_skew, reference| ModelSpec {
        name,
        family: Family::GptOss,
        n_layer,
        n_embd: 2880,
        n_head: 64,
        n_head_kv: 8,
        head_dim: 64,
        n_vocab: 201_088,
        n_ctx_train: 131_072,
        n_ff: 2880,
        n_ff_exp: 2880,
        n_expert,
        n_expert_used: 4,
        rope_freq_base: 150_000.0,
        rms_eps: 1e-5,
        yarn: Some((32.0, 4096)),
        sliding_window: Some(128),
        recipe: Recipe::Mxfp4Moe,
        routing_skew,
        reference,
    };
    let qwen3 = |name, n_layer, n_embd, n_head, n_ff, n_ff_exp, reference| ModelSpec {
        name,
        family: Family::Qwen3Moe,
        n_layer,
        n_embd,
        n_head,
        n_head_kv: 4,
        head_dim: 128,
        n_vocab: 151_936,
        n_ctx_train: 40_960,
        n_ff,
        n_ff_exp,
        n_expert: 128,
        n_expert_used: 8,
        rope_freq_base: 1_000_000.0,
        rms_eps: 1e-6,
        yarn: None,
        sliding_window: None,
        recipe: Recipe::Q4KM,
        routing_skew: 0.65,
        reference,
    };
    Ok(match name {
        "gpt-oss-20b" => gpt_oss(
            "gpt-oss-20b",
            24,
            32,
            0.6,
            Reference {
                file: "gpt-oss-20b-mxfp4.gguf",
                bytes: 12_100_000_000,
                source: "huggingface.co/ggml-org/gpt-oss-20b-GGUF (12.1 GB; bartowski's MXFP4 file is also 12.1 GB)",
            },
        ),
        "gpt-oss-120b" => gpt_oss(
            "gpt-oss-120b",
            36,
            128,
            0.7,
            Reference {
                file: "gpt-oss-120b-mxfp4-0000{1,2,3}-of-00003.gguf",
                bytes: 63_400_000_000,
                source: "huggingface.co/ggml-org/gpt-oss-120b-GGUF (three parts, 63.4 GB together)",
            },
        ),
        "qwen3-30b-a3b" => qwen3(
            "qwen3-30b-a3b",
            48,
            2048,
            32,
            6144,
            768,
            Reference {
                file: "Qwen3-30B-A3B-Q4_K_M.gguf",
                bytes: 18_630_000_000,
                source: "huggingface.co/bartowski/Qwen_Qwen3-30B-A3B-GGUF (18.63 GB = 17.35 GiB; Qwen's own Q4_K_M is 18.6 GB)",
            },
        ),
        "qwen3-235b-a22b" => qwen3(
            "qwen3-235b-a22b",
            94,
            4096,
            64,
            12_288,
            1536,
            Reference {
                file: "Qwen3-235B-A22B-Q4_K_M-0000{1..3}-of-00003.gguf",
                bytes: 142_000_000_000,
                source: "huggingface.co/Qwen/Qwen3-235B-A22B-GGUF Q4_K_M (about 142 GB in parts; not re-checked)",
            },
        ),
        "mixtral-8x7b" => ModelSpec {
            name: "mixtral-8x7b",
            family: Family::Mixtral,
            n_layer: 32,
            n_embd: 4096,
            n_head: 32,
            n_head_kv: 8,
            head_dim: 128,
            n_vocab: 32_000,
            n_ctx_train: 32_768,
            n_ff: 14_336,
            n_ff_exp: 14_336,
            n_expert: 8,
            n_expert_used: 2,
            rope_freq_base: 1_000_000.0,
            rms_eps: 1e-5,
            yarn: None,
            sliding_window: None,
            recipe: Recipe::Q4KM,
            routing_skew: 0.5,
            reference: Reference {
                file: "mixtral-8x7b-instruct-v0.1.Q4_K_M.gguf",
                bytes: 28_440_000_000,
                source: "huggingface.co/MaziyarPanahi/Mixtral-8x7B-Instruct-v0.1-GGUF (26.49 GiB as localmodel.run lists it)",
            },
        },
        _ => return Err(SynthError::UnknownModel { name: name.into(), choices: NAMES.join(", ") }),
    })
}

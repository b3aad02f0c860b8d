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
    /// `qwen35moe` (Qwen3.5 MoE): Gated DeltaNet layers and every fourth layer gated
    /// attention, a sigmoid-gated shared expert; beta and alpha projections apart.
    Qwen35Moe,
    /// `qwen3next` (Qwen3-Next): the same blocks, beta and alpha in one `ssm_ba`.
    Qwen3Next,
    /// `gemma4` (Gemma 4 MoE): sliding and global layers of their own shapes, a dense
    /// MLP beside the experts, gate and up of the experts in one tensor, tied output.
    Gemma4,
}

impl Family {
    /// `general.architecture`.
    pub fn gguf_arch(self) -> &'static str {
        match self {
            Family::GptOss => "gpt-oss",
            Family::Qwen3Moe => "qwen3moe",
            Family::Mixtral => "llama",
            Family::Qwen35Moe => "qwen35moe",
            Family::Qwen3Next => "qwen3next",
            Family::Gemma4 => "gemma4",
        }
    }

    /// The output projection is the token embedding table (no `output.weight`).
    pub fn tied_output(self) -> bool {
        self == Family::Gemma4
    }

    /// Gated DeltaNet and gated-attention layers (docs/FAMILIES.md §6).
    pub fn is_hybrid(self) -> bool {
        matches!(self, Family::Qwen35Moe | Family::Qwen3Next)
    }
}

/// Shapes of the Gated DeltaNet layers of a hybrid model (`{arch}.ssm.*`, docs/FAMILIES.md §6.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearAttention {
    /// Key (and query) heads: `ssm.group_count`.
    pub n_k_heads: usize,
    /// Value heads: `ssm.time_step_rank`.
    pub n_v_heads: usize,
    /// Size of a key head and of a value head: `ssm.state_size` (llama.cpp needs them equal).
    pub head_dim: usize,
    /// Taps of the causal convolution: `ssm.conv_kernel`.
    pub conv_kernel: usize,
    /// Every this-many-th layer is softmax attention, the others linear (`full_attention_interval`).
    pub full_attention_interval: usize,
}

impl LinearAttention {
    /// Channels of the convolved projection `attn_qkv`: q heads, k heads, v heads.
    pub fn conv_dim(&self) -> usize {
        2 * self.n_k_heads * self.head_dim + self.v_dim()
    }

    /// `ssm.inner_size`: all value heads.
    pub fn v_dim(&self) -> usize {
        self.n_v_heads * self.head_dim
    }

    /// Whether layer `il` is linear attention (`(il + 1) % interval != 0`).
    pub fn is_recurrent(&self, il: usize) -> bool {
        !(il + 1).is_multiple_of(self.full_attention_interval)
    }
}

/// Gemma 4's sliding-window layers (docs/FAMILIES.md §7.5); the spec's `head_dim`,
/// `n_head_kv` and `rope_freq_base` are its global layers'.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SlidingLayers {
    /// Layer il is global iff `il % global_every == global_every - 1`.
    pub global_every: usize,
    pub head_dim: usize,
    pub n_head_kv: usize,
    pub rope_freq_base: f32,
    /// Dimensions of a global head that rotate (proportional rope: the rest are
    /// frozen through `rope_freqs`).
    pub global_rotated: usize,
}

impl SlidingLayers {
    pub fn is_sliding(&self, il: usize) -> bool {
        !(il + 1).is_multiple_of(self.global_every)
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
    /// Size as published (decimal GB × 1e9 or GiB × 2³⁰, so only to the precision shown),
    /// or, where no file of the stock recipe was found, computed from the recipe by hand
    /// (`source` says which).
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
    /// `feed_forward_length` as the converter writes it (HF `intermediate_size`); 0 where
    /// the config has none and the key is not written (qwen35moe).
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
    /// `rope.dimension_count`, where the converter writes it (rotary dimensions per head).
    pub rope_dims: Option<usize>,
    /// `rope.dimension_sections` (qwen35moe's multi-axis rope; text uses the first section only).
    pub rope_sections: Option<[i32; 4]>,
    /// Hidden width of the shared expert (`expert_shared_feed_forward_length`); 0 without one.
    pub n_ff_shexp: usize,
    /// The Gated DeltaNet layers of a hybrid model.
    pub linear: Option<LinearAttention>,
    /// Gemma 4's sliding layers (and `sliding_window` their window).
    pub sliding: Option<SlidingLayers>,
    /// `tokenizer.ggml.pre` of the public file (the vocabulary written here has no tokens).
    pub tokenizer_pre: Option<&'static str>,
    pub recipe: Recipe,
    /// Exponent θ of the expert popularity law `rank^-θ` in skewed routing (docs/SYNTH.md).
    pub routing_skew: f32,
    pub reference: Reference,
}

/// The names `spec` knows.
pub const NAMES: [&str; 10] = [
    "gpt-oss-20b",
    "gpt-oss-120b",
    "qwen3-30b-a3b",
    "qwen3-235b-a22b",
    "mixtral-8x7b",
    "qwen3.5-35b-a3b",
    "qwen3.5-122b-a10b",
    "qwen3.5-397b-a17b",
    "qwen3-next-80b-a3b",
    "gemma4-26b-a4b",
];

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
        rope_dims: None,
        rope_sections: None,
        n_ff_shexp: 0,
        linear: None,
        sliding: None,
        tokenizer_pre: Some("gpt-4o"),
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
        rope_dims: None,
        rope_sections: None,
        n_ff_shexp: 0,
        linear: None,
        sliding: None,
        tokenizer_pre: Some("qwen2"),
        recipe: Recipe::Q4KM,
        routing_skew: 0.65,
        reference,
    };
    // docs/FAMILIES.md §6.7: every release has head size 256 with 2 kv heads, 16 key heads
    // of 128 in the linear layers, 4 conv taps, rope on a quarter of each head (base 1e7),
    // a context of 262144, and every fourth layer attention.
    let hybrid = |name, family, n_layer, n_embd, n_head, n_v_heads, n_expert, n_expert_used, n_ff_exp, reference| {
        let qwen35 = family == Family::Qwen35Moe;
        ModelSpec {
            name,
            family,
            n_layer,
            n_embd,
            n_head,
            n_head_kv: 2,
            head_dim: 256,
            n_vocab: if qwen35 { 248_320 } else { 151_936 },
            n_ctx_train: 262_144,
            // Qwen3-Next's config has `intermediate_size` (unused: every layer is MoE);
            // Qwen3.5's has none, so the converter writes no feed_forward_length.
            n_ff: if qwen35 { 0 } else { 5120 },
            n_ff_exp,
            n_expert,
            n_expert_used,
            rope_freq_base: 10_000_000.0,
            rms_eps: 1e-6,
            yarn: None,
            sliding_window: None,
            rope_dims: Some(64),
            rope_sections: qwen35.then_some([11, 11, 10, 0]),
            n_ff_shexp: n_ff_exp,
            sliding: None,
            linear: Some(LinearAttention {
                n_k_heads: 16,
                n_v_heads,
                head_dim: 128,
                conv_kernel: 4,
                full_attention_interval: 4,
            }),
            tokenizer_pre: Some(if qwen35 { "qwen35" } else { "qwen2" }),
            recipe: Recipe::Q4KM,
            // With 256 experts of which 8 or 512 of which 10, consecutive tokens share a
            // quarter of their experts at this skew (docs/SYNTH.md).
            routing_skew: 0.67,
            reference,
        }
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
            rope_dims: Some(128),
            rope_sections: None,
            n_ff_shexp: 0,
            linear: None,
            sliding: None,
            tokenizer_pre: None,
            recipe: Recipe::Q4KM,
            routing_skew: 0.5,
            reference: Reference {
                file: "mixtral-8x7b-instruct-v0.1.Q4_K_M.gguf",
                bytes: 28_440_000_000,
                source: "huggingface.co/MaziyarPanahi/Mixtral-8x7B-Instruct-v0.1-GGUF (26.49 GiB as localmodel.run lists it)",
            },
        },
        "qwen3.5-35b-a3b" => hybrid(
            "qwen3.5-35b-a3b",
            Family::Qwen35Moe,
            40,
            2048,
            16,
            32,
            256,
            8,
            512,
            Reference {
                file: "Qwen3.5-35B-A3B-Q4_K_M.gguf",
                bytes: 21_200_000_000,
                source: "the official Q4_K_M as GOBA-AI-Labs' PrunedHub-Qwen3.5-35B-A3B card quotes it (21.2 GB); docs/FAMILIES.md §6.7 computes 19.70 GiB from the recipe",
            },
        ),
        "qwen3.5-122b-a10b" => hybrid(
            "qwen3.5-122b-a10b",
            Family::Qwen35Moe,
            48,
            3072,
            32,
            64,
            256,
            8,
            1024,
            Reference {
                file: "Qwen3.5-122B-A10B-Q4_K_M.gguf",
                bytes: 74_201_739_264,
                source: "no stock Q4_K_M listing found: tensor data computed by hand from the recipe of docs/FAMILIES.md §6.7 (69.11 GiB)",
            },
        ),
        "qwen3.5-397b-a17b" => hybrid(
            "qwen3.5-397b-a17b",
            Family::Qwen35Moe,
            60,
            4096,
            32,
            64,
            512,
            10,
            1024,
            Reference {
                file: "Qwen3.5-397B-A17B-Q4_K_M-0000{1..}.gguf",
                bytes: 240_593_923_072,
                source: "no stock Q4_K_M listing found (bartowski's files upcast ssm_alpha/beta and ssm_out): docs/FAMILIES.md §6.7's 224.07 GiB, computed from the recipe",
            },
        ),
        "qwen3-next-80b-a3b" => hybrid(
            "qwen3-next-80b-a3b",
            Family::Qwen3Next,
            48,
            2048,
            16,
            32,
            512,
            10,
            512,
            Reference {
                file: "Qwen3-Next-80B-A3B-Instruct-Q4_K_M.gguf",
                bytes: 48_404_281_426,
                source: "45.08 GiB in a published load log of a Q4_K_M with the older ssm_in layout (lmstudio-bug-tracker #1266, docs/FAMILIES.md §6.7), 0.15% below the attn_qkv layout",
            },
        ),
        // docs/FAMILIES.md §7.5: 30 layers, every sixth global (head 512, 2 kv heads, V = K,
        // base 1e6, a quarter of its dims rotating), the others sliding (head 256, 8 kv heads,
        // window 1024, base 1e4); a dense MLP of 2112 beside 128 experts of 704, top-8.
        "gemma4-26b-a4b" => ModelSpec {
            name: "gemma4-26b-a4b",
            family: Family::Gemma4,
            n_layer: 30,
            n_embd: 2816,
            n_head: 16,
            n_head_kv: 2,
            head_dim: 512,
            n_vocab: 262_144,
            n_ctx_train: 262_144,
            n_ff: 2112,
            n_ff_exp: 704,
            n_expert: 128,
            n_expert_used: 8,
            rope_freq_base: 1_000_000.0,
            rms_eps: 1e-6,
            yarn: None,
            sliding_window: Some(1024),
            rope_dims: Some(512),
            rope_sections: None,
            n_ff_shexp: 0,
            linear: None,
            sliding: Some(SlidingLayers {
                global_every: 6,
                head_dim: 256,
                n_head_kv: 8,
                rope_freq_base: 10_000.0,
                global_rotated: 128,
            }),
            tokenizer_pre: Some("gemma4"),
            recipe: Recipe::Q4KM,
            routing_skew: 0.65,
            reference: Reference {
                file: "gemma-4-26B-A4B-it-Q4_K_M.gguf",
                bytes: 16_782_504_591,
                source: "15.63 GiB in the published load log of lmstudio-community's file (scrya-com/rotorquant #9, ollama #16647); docs/FAMILIES.md §7.5 reproduces its 658 tensors' types",
            },
        },
        _ => return Err(SynthError::UnknownModel { name: name.into(), choices: NAMES.join(", ") }),
    })
}

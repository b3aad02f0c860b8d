//! `ArchConfig`: everything about a model's shape and wiring, read once from
//! GGUF metadata. Family defaults follow llama.cpp (docs/FAMILIES.md cites
//! the source of each); a key the file carries overrides a default only where
//! llama.cpp would read it too.

use crate::ModelError;
use ts_cpu::ops::GatedActivation;
use ts_gguf::{Array, Metadata, Value};

/// The architectures this engine runs, by `general.architecture`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama and Mistral, and Mixtral when the file has experts.
    Llama,
    Qwen2,
    Qwen3,
    Gemma3,
    Qwen2Moe,
    Qwen3Moe,
    Olmoe,
    GptOss,
}

impl Arch {
    pub const ALL: [Arch; 8] = [
        Arch::Llama,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Gemma3,
        Arch::Qwen2Moe,
        Arch::Qwen3Moe,
        Arch::Olmoe,
        Arch::GptOss,
    ];

    /// The `general.architecture` string.
    pub fn gguf_name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
            Arch::Qwen2Moe => "qwen2moe",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Olmoe => "olmoe",
            Arch::GptOss => "gpt-oss",
        }
    }

    pub fn from_gguf_name(name: &str) -> Result<Arch, ModelError> {
        Arch::ALL.into_iter().find(|a| a.gguf_name() == name).ok_or_else(|| {
            let known: Vec<&str> = Arch::ALL.iter().map(|a| a.gguf_name()).collect();
            ModelError::UnknownArchitecture { name: name.into(), known: known.join(", ") }
        })
    }
}

/// Pairing of rotary dimensions (see `ts_cpu::ops::RopeLayout`).
pub use ts_cpu::ops::RopeLayout;

/// Frequency scaling of the rotary embedding.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// YaRN (arXiv:2309.00071) in ggml's form: `beta_fast`/`beta_slow` bound the
    /// ramp between interpolated and extrapolated frequencies.
    Yarn {
        factor: f32,
        original_context: usize,
        beta_fast: f32,
        beta_slow: f32,
        truncate: bool,
    },
}

/// Rotary embedding settings of one layer.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    pub layout: RopeLayout,
    pub n_rot: usize,
    pub freq_base: f32,
    pub scaling: RopeScaling,
    /// Multiplies cos and sin (`rope.scaling.attn_factor`, 1 by default).
    pub attn_factor: f32,
}

/// How the router turns logits into expert weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over all experts, then top-k of the probabilities.
    Softmax,
    /// Top-k of the raw logits, then softmax over the k selected (gpt-oss).
    SoftmaxOverTopK,
}

/// The shared expert beside the routed ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedExpert {
    pub n_ff: usize,
    /// Output scaled by `sigmoid(w · x)` (qwen2moe).
    pub sigmoid_gated: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub n_expert: usize,
    pub n_expert_used: usize,
    /// Hidden width of one routed expert.
    pub n_ff_exp: usize,
    pub gating: Gating,
    /// Divide the k selected weights by their sum.
    pub renormalize: bool,
    pub shared: Option<SharedExpert>,
}

/// Normalisation of q and k before rope.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// RMS norm over each head (weight `[head_dim]`).
    PerHead,
    /// RMS norm over the whole projection (weight `[n_head * head_dim]`, olmoe).
    Full,
}

/// Per-layer attention settings.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerConfig {
    /// A query at position p sees keys at positions in `(p - w, p]`.
    pub sliding_window: Option<usize>,
    pub rope: RopeConfig,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ArchConfig {
    pub arch: Arch,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub head_dim_v: usize,
    /// Dense FFN width (0 when every layer is MoE).
    pub n_ff: usize,
    pub rms_eps: f32,
    pub layers: Vec<LayerConfig>,
    /// Multiplies q·k.
    pub attn_scale: f32,
    /// Multiplies the token embeddings (gemma3: sqrt(n_embd)).
    pub embed_scale: Option<f32>,
    /// `c * tanh(logits / c)` on the output logits.
    pub final_softcap: Option<f32>,
    pub qk_norm: QkNorm,
    /// Norms after attention and after the FFN, before each residual add (gemma3).
    pub post_norms: bool,
    pub ffn_act: GatedActivation,
    pub moe: Option<MoeConfig>,
    /// One learned logit per query head joins each attention softmax (gpt-oss).
    pub attn_sinks: bool,
}

/// Typed access to `{arch}.key` with errors naming the key.
struct Keys<'a> {
    md: &'a Metadata,
    arch: &'a str,
}

impl Keys<'_> {
    fn name(&self, key: &str) -> String {
        format!("{}.{key}", self.arch)
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.md.get(&self.name(key))
    }

    fn usize(&self, key: &str) -> Result<Option<usize>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            // A per-layer array: layer 0 sizes the tensors (llama.cpp does the same for these families).
            Some(Value::Array(a)) => {
                let v = a.to_i64s().and_then(|v| v.first().copied()).and_then(|v| usize::try_from(v).ok());
                v.map(Some).ok_or_else(|| self.bad(key, "an array of non-negative integers"))
            }
            Some(v) => v.as_u64().map(|v| Some(v as usize)).ok_or_else(|| self.bad(key, "a non-negative integer")),
        }
    }

    fn req_usize(&self, key: &str) -> Result<usize, ModelError> {
        self.usize(key)?.ok_or_else(|| ModelError::MissingKey(self.name(key)))
    }

    fn f32(&self, key: &str) -> Result<Option<f32>, ModelError> {
        self.get(key).map(|v| v.as_f64().map(|x| x as f32).ok_or_else(|| self.bad(key, "a number"))).transpose()
    }

    fn str(&self, key: &str) -> Result<Option<&str>, ModelError> {
        self.get(key).map(|v| v.as_str().ok_or_else(|| self.bad(key, "a string"))).transpose()
    }

    fn bad(&self, key: &str, expected: &str) -> ModelError {
        ModelError::BadKey { key: self.name(key), problem: format!("expected {expected}") }
    }
}

impl ArchConfig {
    /// Reads the configuration; `n_vocab` comes from the embedding table's shape.
    pub fn from_metadata(md: &Metadata, n_vocab: usize) -> Result<ArchConfig, ModelError> {
        let arch_name = md.architecture().map_err(|_| ModelError::MissingKey("general.architecture".into()))?;
        let arch = Arch::from_gguf_name(arch_name)?;
        let k = Keys { md, arch: arch_name };

        let n_layer = k.req_usize("block_count")?;
        let n_embd = k.req_usize("embedding_length")?;
        let n_head = k.req_usize("attention.head_count")?;
        if n_layer == 0 || n_embd == 0 || n_head == 0 {
            return Err(ModelError::BadKey {
                key: k.name("block_count / embedding_length / attention.head_count"),
                problem: "must be non-zero".into(),
            });
        }
        let n_head_kv = k.usize("attention.head_count_kv")?.unwrap_or(n_head);
        if n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(ModelError::BadKey {
                key: k.name("attention.head_count_kv"),
                problem: format!("{n_head_kv} does not divide the {n_head} query heads"),
            });
        }
        let head_dim = k.usize("attention.key_length")?.unwrap_or(n_embd / n_head);
        let head_dim_v = k.usize("attention.value_length")?.unwrap_or(head_dim);
        let n_rot = k.usize("rope.dimension_count")?.unwrap_or(head_dim);
        if n_rot > head_dim || n_rot % 2 != 0 {
            return Err(ModelError::BadKey {
                key: k.name("rope.dimension_count"),
                problem: format!("{n_rot} must be even and at most the head size {head_dim}"),
            });
        }
        let rms_eps = k
            .f32("attention.layer_norm_rms_epsilon")?
            .ok_or_else(|| ModelError::MissingKey(k.name("attention.layer_norm_rms_epsilon")))?;
        let n_ff = k.usize("feed_forward_length")?.unwrap_or(0);

        let rope = RopeConfig {
            layout: if arch == Arch::Llama { RopeLayout::Interleaved } else { RopeLayout::Halves },
            n_rot,
            freq_base: k.f32("rope.freq_base")?.unwrap_or(10_000.0),
            scaling: rope_scaling(&k, arch)?,
            attn_factor: k.f32("rope.scaling.attn_factor")?.unwrap_or(1.0),
        };

        let sliding = sliding_layers(&k, arch, n_layer)?;
        let local_rope = match arch {
            // Local layers: their own base, no frequency scaling.
            Arch::Gemma3 => RopeConfig {
                freq_base: k.f32("rope.freq_base_swa")?.unwrap_or(10_000.0),
                scaling: RopeScaling::None,
                ..rope.clone()
            },
            Arch::GptOss => {
                RopeConfig { freq_base: k.f32("rope.freq_base_swa")?.unwrap_or(rope.freq_base), ..rope.clone() }
            }
            _ => rope.clone(),
        };
        let layers = sliding
            .into_iter()
            .map(|w| LayerConfig {
                sliding_window: w,
                rope: if w.is_some() { local_rope.clone() } else { rope.clone() },
            })
            .collect();

        let attn_scale = match arch {
            // llama.cpp: 1/sqrt(n_embd/n_head) for the 62-layer 27B, else 1/sqrt(head_dim).
            Arch::Gemma3 if n_layer == 62 => 1.0 / ((n_embd / n_head) as f32).sqrt(),
            _ => 1.0 / (head_dim as f32).sqrt(),
        };

        let moe = moe_config(&k, arch, n_ff)?;
        let ffn_act = match arch {
            Arch::Gemma3 => GatedActivation::GeGlu,
            Arch::GptOss => GatedActivation::SwiGluClamped { alpha: 1.702, limit: 7.0 },
            _ => GatedActivation::SwiGlu,
        };
        let final_softcap = match arch {
            Arch::Gemma3 => k.f32("final_logit_softcapping")?.filter(|&c| c > 0.0),
            _ => None,
        };

        Ok(ArchConfig {
            arch,
            n_layer,
            n_embd,
            n_vocab,
            n_ctx_train: k.usize("context_length")?.unwrap_or(0),
            n_head,
            n_head_kv,
            head_dim,
            head_dim_v,
            n_ff,
            rms_eps,
            layers,
            attn_scale,
            embed_scale: (arch == Arch::Gemma3).then(|| (n_embd as f32).sqrt()),
            final_softcap,
            qk_norm: match arch {
                Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3 => QkNorm::PerHead,
                Arch::Olmoe => QkNorm::Full,
                _ => QkNorm::None,
            },
            post_norms: arch == Arch::Gemma3,
            ffn_act,
            moe,
            attn_sinks: arch == Arch::GptOss,
        })
    }

    /// Width of the concatenated query heads.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Width of one token's keys (all kv heads).
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    pub fn v_dim(&self) -> usize {
        self.n_head_kv * self.head_dim_v
    }
}

fn rope_scaling(k: &Keys, arch: Arch) -> Result<RopeScaling, ModelError> {
    let factor = match k.f32("rope.scaling.factor")? {
        Some(f) => Some(f),
        None => k.f32("rope.scale_linear")?,
    };
    let ty = k.str("rope.scaling.type")?.unwrap_or("linear");
    Ok(match (ty, factor) {
        ("none", _) | (_, None) => RopeScaling::None,
        (_, Some(f)) if f == 0.0 || f == 1.0 && ty == "linear" => RopeScaling::None,
        ("linear", Some(factor)) => RopeScaling::Linear { factor },
        ("yarn", Some(factor)) => RopeScaling::Yarn {
            factor,
            original_context: k
                .usize("rope.scaling.original_context_length")?
                .or(k.usize("context_length")?)
                .unwrap_or(0),
            // Fixed betas, as llama.cpp uses for these families. The ramp bounds are rounded to
            // whole dimensions except for gpt-oss, whose reference config sets `truncate: false`
            // (llama.cpp always rounds; docs/FAMILIES.md §5.1).
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: arch != Arch::GptOss,
        },
        (other, _) => {
            return Err(ModelError::BadKey {
                key: k.name("rope.scaling.type"),
                problem: format!("'{other}' is not supported (none, linear, yarn)"),
            });
        }
    })
}

/// The sliding window of each layer (`None` = full attention).
fn sliding_layers(k: &Keys, arch: Arch, n_layer: usize) -> Result<Vec<Option<usize>>, ModelError> {
    let default_period = match arch {
        Arch::Gemma3 => 6,
        Arch::GptOss => 2,
        // llama.cpp applies no window for the other families, whatever the file says.
        _ => return Ok(vec![None; n_layer]),
    };
    let window = match k.usize("attention.sliding_window")? {
        Some(w) if w > 0 => w,
        _ if arch == Arch::GptOss => return Err(ModelError::MissingKey(k.name("attention.sliding_window"))),
        _ => return Ok(vec![None; n_layer]),
    };
    // The pattern is either a period n (every n-th layer is global) or one flag per layer.
    match k.get("attention.sliding_window_pattern") {
        Some(Value::Array(a)) => {
            let flags: Vec<bool> = match a {
                Array::Bool(v) => v.clone(),
                other => other.to_i64s().map(|v| v.iter().map(|&x| x != 0).collect()).unwrap_or_default(),
            };
            if flags.len() != n_layer {
                return Err(ModelError::BadKey {
                    key: k.name("attention.sliding_window_pattern"),
                    problem: format!("{} flags for {n_layer} layers", flags.len()),
                });
            }
            Ok(flags.into_iter().map(|f| f.then_some(window)).collect())
        }
        _ => {
            let period = k.usize("attention.sliding_window_pattern")?.unwrap_or(default_period);
            // llama.cpp's set_swa_pattern: layer il is local iff il % n < n - 1 (n = 0 or 1: all local... or none).
            Ok((0..n_layer).map(|il| (period > 1 && il % period < period - 1).then_some(window)).collect())
        }
    }
}

fn moe_config(k: &Keys, arch: Arch, n_ff: usize) -> Result<Option<MoeConfig>, ModelError> {
    let n_expert = k.usize("expert_count")?.unwrap_or(0);
    let needs_moe = matches!(arch, Arch::Qwen2Moe | Arch::Qwen3Moe | Arch::Olmoe | Arch::GptOss);
    if n_expert == 0 {
        return if needs_moe { Err(ModelError::MissingKey(k.name("expert_count"))) } else { Ok(None) };
    }
    let n_expert_used = k.req_usize("expert_used_count")?;
    if n_expert_used == 0 || n_expert_used > n_expert {
        return Err(ModelError::BadKey {
            key: k.name("expert_used_count"),
            problem: format!("{n_expert_used} must be between 1 and expert_count {n_expert}"),
        });
    }
    let n_ff_exp = match arch {
        Arch::Llama | Arch::Olmoe => n_ff,
        Arch::GptOss => k.req_usize("expert_feed_forward_length")?,
        _ => k.usize("expert_feed_forward_length")?.unwrap_or(n_ff / n_expert_used),
    };
    let shared = match arch {
        Arch::Qwen2Moe => Some(SharedExpert {
            n_ff: k.usize("expert_shared_feed_forward_length")?.unwrap_or(n_ff),
            sigmoid_gated: true,
        }),
        _ => None,
    };
    Ok(Some(MoeConfig {
        n_expert,
        n_expert_used,
        n_ff_exp,
        gating: if arch == Arch::GptOss { Gating::SoftmaxOverTopK } else { Gating::Softmax },
        renormalize: matches!(arch, Arch::Llama | Arch::Qwen3Moe),
        shared,
    }))
}

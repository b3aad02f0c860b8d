//! `ArchConfig`: everything about a model's shape and wiring, read once from
//! GGUF metadata. What each family leaves out of its metadata comes from its
//! file in `family/`; a key the file carries overrides a default only where
//! llama.cpp would read it too.

use crate::ModelError;
use crate::family::{ExpertWidth, LocalRope};
use ts_gguf::{Array, Metadata, Value};

pub use crate::family::Arch;

/// How rotary dimensions are paired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Adjacent pairs (2i, 2i+1): llama.cpp's `NORM`, Llama.
    Interleaved,
    /// Halves (i, i + n_rot/2): llama.cpp's `NEOX`, most other families.
    Halves,
}

/// The gated activation of an FFN: `act(gate) * up`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GatedActivation {
    /// `silu(gate) * up`
    SwiGlu,
    /// `gelu_tanh(gate) * up`
    GeGlu,
    /// gpt-oss: `g = min(gate, limit)`, `u = clamp(up, -limit, limit)`,
    /// `g * sigmoid(alpha * g) * (u + 1)`.
    SwiGluClamped { alpha: f32, limit: f32 },
}

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

/// Settings of a softmax-attention layer (families whose sliding and global
/// layers differ, Gemma 4's, set them per layer).
#[derive(Clone, Debug, PartialEq)]
pub struct AttnLayer {
    /// A query at position p sees keys at positions in `(p - w, p]`.
    pub sliding_window: Option<usize>,
    pub rope: RopeConfig,
    /// Whether the file's `rope_freqs` divides this layer's rotary frequencies.
    pub rope_freq_factors: bool,
    pub n_head_kv: usize,
    /// Size of a query and key head, and of a value head.
    pub head_dim: usize,
    pub head_dim_v: usize,
    /// The layer reads the keys and values of this earlier layer and stores none.
    pub kv_from: Option<usize>,
}

impl AttnLayer {
    /// Width of one token's keys (all kv heads).
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    pub fn v_dim(&self) -> usize {
        self.n_head_kv * self.head_dim_v
    }
}

/// What mixes positions in a layer, and so what state a sequence keeps for it.
#[derive(Clone, Debug, PartialEq)]
pub enum Mixer {
    /// Softmax attention over the sequence's KV cache.
    Attention(AttnLayer),
    /// Gated DeltaNet linear attention over a recurrent state ([`ArchConfig::delta_net`]).
    DeltaNet,
}

/// Which key head a value head reads when there are more value heads than key heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyHeadOf {
    /// Value head h reads key head `h % n_k_heads` (qwen35moe: the converter reorders v heads).
    Tiled,
    /// Value head h reads key head `h / (n_v_heads / n_k_heads)` (qwen3next).
    Grouped,
}

/// Shapes of the Gated DeltaNet layers.
#[derive(Clone, Debug, PartialEq)]
pub struct DeltaNetConfig {
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    /// Size of a key (and query) head, and of a value head.
    pub d_k: usize,
    pub d_v: usize,
    /// Taps of the causal depthwise convolution over q, k and v.
    pub conv_kernel: usize,
    pub key_head_of: KeyHeadOf,
}

impl DeltaNetConfig {
    /// Width of the convolved projection: q heads, k heads, v heads.
    pub fn conv_dim(&self) -> usize {
        2 * self.n_k_heads * self.d_k + self.n_v_heads * self.d_v
    }

    pub fn v_dim(&self) -> usize {
        self.n_v_heads * self.d_v
    }

    pub fn conv_state_len(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_dim()
    }

    pub fn ssm_state_len(&self) -> usize {
        self.n_v_heads * self.d_k * self.d_v
    }

    /// The key head value head `h` reads.
    pub fn key_head(&self, h: usize) -> usize {
        match self.key_head_of {
            KeyHeadOf::Tiled => h % self.n_k_heads,
            KeyHeadOf::Grouped => h / (self.n_v_heads / self.n_k_heads),
        }
    }
}

/// One layer's plan: its mixer, then a dense or MoE FFN.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerConfig {
    pub mixer: Mixer,
    /// The FFN has routed experts (beside a dense MLP where the family has both).
    pub moe: bool,
    /// Width of the layer's dense MLP (0 where it has none).
    pub n_ff: usize,
}

impl LayerConfig {
    /// The attention settings, for an attention layer.
    pub fn attention(&self) -> Option<&AttnLayer> {
        match &self.mixer {
            Mixer::Attention(a) => Some(a),
            Mixer::DeltaNet => None,
        }
    }

    /// The sliding window of an attention layer.
    pub fn sliding_window(&self) -> Option<usize> {
        self.attention().and_then(|a| a.sliding_window)
    }
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
    /// Attention output multiplied by `sigmoid(gate)`, the gate a second half of
    /// each query head's projection (qwen35moe, qwen3next).
    pub attn_output_gate: bool,
    /// Shapes of the linear-attention layers, when the model has any.
    pub delta_net: Option<DeltaNetConfig>,
    /// Multi-token-prediction layers after the main ones (`nextn_predict_layers`),
    /// not part of the main forward pass.
    pub n_nextn: usize,
    /// The plan of the first multi-token-prediction layer (GGUF block `n_layer`), where the
    /// file has one: a full-attention layer with the trunk's attention settings and FFN kind.
    pub nextn_layer: Option<LayerConfig>,
    /// Width of each layer's slice of the per-layer embeddings (Gemma 4's E models; 0: none).
    pub per_layer_input: usize,
}

impl ArchConfig {
    /// The family's wiring.
    pub fn family(&self) -> &'static crate::family::Family {
        self.arch.family()
    }
}

/// Typed access to `{arch}.key` with errors naming the key.
pub struct Keys<'a> {
    md: &'a Metadata,
    arch: &'a str,
    family: &'static crate::family::Family,
}

impl Keys<'_> {
    pub fn family(&self) -> &'static crate::family::Family {
        self.family
    }

    pub fn name(&self, key: &str) -> String {
        format!("{}.{key}", self.arch)
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.md.get(&self.name(key))
    }

    pub fn usize(&self, key: &str) -> Result<Option<usize>, ModelError> {
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

    /// A per-layer key for `n` layers: an array of at least `n` (the first `n`
    /// taken), or one value for every layer.
    pub fn per_layer(&self, key: &str, n: usize) -> Result<Option<Vec<usize>>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => {
                let v = a.to_i64s().filter(|v| v.len() >= n && v.iter().all(|&x| x >= 0));
                let v = v.ok_or_else(|| self.bad(key, &format!("an array of {n} non-negative integers")))?;
                Ok(Some(v[..n].iter().map(|&x| x as usize).collect()))
            }
            Some(_) => Ok(self.usize(key)?.map(|x| vec![x; n])),
        }
    }

    /// A per-layer array of flags, at least `n` long (the first `n` taken).
    pub fn flags(&self, key: &str, n: usize) -> Result<Option<Vec<bool>>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(Array::Bool(v))) if v.len() >= n => Ok(Some(v[..n].to_vec())),
            Some(_) => Err(self.bad(key, &format!("an array of {n} booleans"))),
        }
    }

    pub fn req_usize(&self, key: &str) -> Result<usize, ModelError> {
        self.usize(key)?.ok_or_else(|| ModelError::MissingKey(self.name(key)))
    }

    pub fn f32(&self, key: &str) -> Result<Option<f32>, ModelError> {
        self.get(key).map(|v| v.as_f64().map(|x| x as f32).ok_or_else(|| self.bad(key, "a number"))).transpose()
    }

    pub fn str(&self, key: &str) -> Result<Option<&str>, ModelError> {
        self.get(key).map(|v| v.as_str().ok_or_else(|| self.bad(key, "a string"))).transpose()
    }

    pub fn bad(&self, key: &str, expected: &str) -> ModelError {
        ModelError::BadKey { key: self.name(key), problem: format!("expected {expected}") }
    }
}

impl ArchConfig {
    /// Reads the configuration; `n_vocab` comes from the embedding table's shape.
    pub fn from_metadata(md: &Metadata, n_vocab: usize) -> Result<ArchConfig, ModelError> {
        let arch_name = md.architecture().map_err(|_| ModelError::MissingKey("general.architecture".into()))?;
        let arch = Arch::from_gguf_name(arch_name)?;
        let fam = arch.family();
        let k = Keys { md, arch: arch_name, family: fam };

        // block_count includes the multi-token-prediction layers, which the main pass skips.
        let n_nextn = k.usize("nextn_predict_layers")?.unwrap_or(0);
        let n_layer = k.req_usize("block_count")?.checked_sub(n_nextn).ok_or_else(|| ModelError::BadKey {
            key: k.name("nextn_predict_layers"),
            problem: format!("{n_nextn} is more than block_count"),
        })?;
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
            layout: fam.rope_layout,
            n_rot,
            freq_base: k.f32("rope.freq_base")?.unwrap_or(10_000.0),
            scaling: rope_scaling(&k, fam.yarn_truncate)?,
            attn_factor: k.f32("rope.scaling.attn_factor")?.unwrap_or(1.0),
        };
        let local_rope = match fam.sliding.map(|s| s.local_rope) {
            Some(LocalRope::OwnBaseUnscaled { default_base }) => RopeConfig {
                freq_base: k.f32("rope.freq_base_swa")?.unwrap_or(default_base),
                scaling: RopeScaling::None,
                ..rope.clone()
            },
            Some(LocalRope::OwnBase) => {
                RopeConfig { freq_base: k.f32("rope.freq_base_swa")?.unwrap_or(rope.freq_base), ..rope.clone() }
            }
            None => rope.clone(),
        };
        let moe = moe_config(&k, n_ff)?;
        let layers = sliding_layers(&k, n_layer)?
            .into_iter()
            .map(|w| LayerConfig {
                mixer: Mixer::Attention(AttnLayer {
                    sliding_window: w,
                    rope: if w.is_some() { local_rope.clone() } else { rope.clone() },
                    rope_freq_factors: true,
                    n_head_kv,
                    head_dim,
                    head_dim_v,
                    kv_from: None,
                }),
                moe: moe.is_some(),
                n_ff,
            })
            .collect();

        let mut cfg = ArchConfig {
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
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            embed_scale: fam.scale_embeddings.then(|| (n_embd as f32).sqrt()),
            final_softcap: match fam.final_softcap {
                true => k.f32("final_logit_softcapping")?.filter(|&c| c > 0.0),
                false => None,
            },
            qk_norm: fam.qk_norm,
            post_norms: fam.post_norms,
            ffn_act: fam.ffn_act,
            moe,
            attn_sinks: fam.attn_sinks,
            attn_output_gate: false,
            delta_net: None,
            n_nextn,
            nextn_layer: None,
            per_layer_input: 0,
        };
        (fam.finish)(&k, &mut cfg)?;
        if n_nextn > 0 {
            // The MTP layer attends as the trunk's full-attention layers do (qwen35moe:
            // `src/models/qwen35moe.cpp` builds it as one), over a cache of its own.
            let attn = cfg.layers.iter().filter_map(|l| l.attention()).find(|a| a.sliding_window.is_none());
            let attn = attn.cloned().ok_or_else(|| ModelError::BadKey {
                key: k.name("nextn_predict_layers"),
                problem: "a multi-token-prediction layer needs the trunk to have a full-attention layer".into(),
            })?;
            cfg.nextn_layer = Some(LayerConfig {
                mixer: Mixer::Attention(AttnLayer { kv_from: None, ..attn }),
                moe: cfg.moe.is_some(),
                n_ff: cfg.n_ff,
            });
        }
        Ok(cfg)
    }

    /// The attention settings of layer `il` (an attention layer).
    pub fn attn(&self, il: usize) -> &AttnLayer {
        self.layers[il].attention().expect("an attention layer")
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

fn rope_scaling(k: &Keys, truncate: bool) -> Result<RopeScaling, ModelError> {
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
            // Fixed betas, as llama.cpp uses for these families; whether the ramp bounds are
            // rounded is the family's (docs/FAMILIES.md §5.1).
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate,
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
fn sliding_layers(k: &Keys, n_layer: usize) -> Result<Vec<Option<usize>>, ModelError> {
    // llama.cpp applies no window for the other families, whatever the file says.
    let Some(sliding) = k.family().sliding else { return Ok(vec![None; n_layer]) };
    let window = match k.usize("attention.sliding_window")? {
        Some(w) if w > 0 => w,
        _ if sliding.window_required => return Err(ModelError::MissingKey(k.name("attention.sliding_window"))),
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
            let period = k.usize("attention.sliding_window_pattern")?.unwrap_or(sliding.period);
            // llama.cpp's set_swa_pattern: layer il is local iff il % n < n - 1 (n = 0 or 1: all local... or none).
            Ok((0..n_layer).map(|il| (period > 1 && il % period < period - 1).then_some(window)).collect())
        }
    }
}

fn moe_config(k: &Keys, n_ff: usize) -> Result<Option<MoeConfig>, ModelError> {
    let Some(wiring) = k.family().moe else { return Ok(None) };
    let n_expert = k.usize("expert_count")?.unwrap_or(0);
    if n_expert == 0 {
        return if wiring.required { Err(ModelError::MissingKey(k.name("expert_count"))) } else { Ok(None) };
    }
    let n_expert_used = k.req_usize("expert_used_count")?;
    if n_expert_used == 0 || n_expert_used > n_expert {
        return Err(ModelError::BadKey {
            key: k.name("expert_used_count"),
            problem: format!("{n_expert_used} must be between 1 and expert_count {n_expert}"),
        });
    }
    let n_ff_exp = match wiring.expert_width {
        ExpertWidth::DenseWidth => n_ff,
        ExpertWidth::Key => k.req_usize("expert_feed_forward_length")?,
        ExpertWidth::KeyOrShare => k.usize("expert_feed_forward_length")?.unwrap_or(n_ff / n_expert_used),
    };
    let shared = match wiring.gated_shared_expert {
        true => Some(SharedExpert {
            n_ff: k.usize("expert_shared_feed_forward_length")?.unwrap_or(n_ff),
            sigmoid_gated: true,
        }),
        false => None,
    };
    Ok(Some(MoeConfig {
        n_expert,
        n_expert_used,
        n_ff_exp,
        gating: wiring.gating,
        renormalize: wiring.renormalize,
        shared,
    }))
}

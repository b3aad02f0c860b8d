//! The one tensor-name table, and the model's weights gathered and validated
//! at open: every tensor a family needs is present, of a type the engine can
//! compute with, and of the right shape, or the open fails naming it.

use crate::ModelError;
use crate::config::{Arch, ArchConfig, AttnLayer, DeltaNetConfig, LayerConfig, Mixer, QkNorm};
use crate::weights::Weight;
use std::collections::HashMap;
use std::sync::Arc;
use ts_gguf::{GgmlType, GgufFile};

/// Every tensor role, with its GGUF base name (llama.cpp's `llama-arch.cpp` table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    TokenEmbd,
    OutputNorm,
    Output,
    AttnNorm,
    AttnQ,
    AttnK,
    AttnV,
    AttnOut,
    AttnQNorm,
    AttnKNorm,
    /// gemma3: norm of the attention output; gpt-oss: the norm before the MoE.
    PostAttnNorm,
    AttnSinks,
    FfnNorm,
    /// gemma3: norm of the FFN output.
    PostFfwNorm,
    /// Llama 3 rope frequency divisors, `[n_rot / 2]`.
    RopeFreqs,
    FfnGate,
    FfnUp,
    FfnDown,
    /// Router: `[n_embd, n_expert]`.
    FfnGateInp,
    FfnGateExps,
    FfnUpExps,
    FfnDownExps,
    /// qwen2moe shared-expert gate: `[n_embd]`.
    FfnGateInpShexp,
    FfnGateShexp,
    FfnUpShexp,
    FfnDownShexp,
    /// Linear attention: q, k and v heads before the convolution, `[n_embd, conv_dim]`.
    AttnQkv,
    /// Linear attention's output gate z, `[n_embd, v_dim]`.
    AttnGate,
    /// Causal convolution taps, `[conv_kernel, conv_dim]`.
    SsmConv1d,
    /// Time-step bias, `[n_v_heads]` (`ssm_dt.bias`).
    SsmDt,
    /// `-exp(A_log)`, `[n_v_heads]`, named without a suffix.
    SsmA,
    SsmBeta,
    SsmAlpha,
    /// qwen3next: beta and alpha in one projection, grouped by key head.
    SsmBa,
    /// qwen3next files of older converters: q, k, v and z in one projection,
    /// grouped by key head (in place of `attn_qkv` and `attn_gate`).
    SsmIn,
    /// Gated RMS norm of each value head's output, `[d_v]`.
    SsmNorm,
    SsmOut,
    /// Gemma 4: each token's per-layer embeddings, `[P·L, n_vocab]`.
    PerLayerTokenEmbd,
    /// Gemma 4: the projection of the embedding to per-layer inputs, `[n_embd, P·L]`.
    PerLayerModelProj,
    /// Gemma 4: the norm of each layer's slice of that projection, `[P]`.
    PerLayerProjNorm,
    /// Gemma 4: a layer's gate over its per-layer input, `[n_embd, P]`.
    InpGate,
    /// Gemma 4: the gated per-layer input back to the stream, `[P, n_embd]`.
    Proj,
    /// Gemma 4: norm of that projection, `[n_embd]`.
    PostNorm,
    /// Gemma 4: the scale of the residual stream after the layer, `[1]`.
    LayerOutputScale,
    /// Gemma 4 MoE: norm of the experts' input, `[n_embd]`.
    PreFfwNorm2,
    /// Gemma 4 MoE: norms of the dense MLP's and of the experts' outputs, `[n_embd]`.
    PostFfwNorm1,
    PostFfwNorm2,
    /// Gate and up of every expert in one tensor, `[n_embd, 2 n_ff_exp, n_expert]`, gate rows first.
    FfnGateUpExps,
    /// MTP head (`blk.{n_layer}.nextn.*`): `[2 n_embd, n_embd]`, reading [normed embedding; normed hidden].
    NextnEhProj,
    /// MTP head: norms of the embedding and of the trunk's hidden state, `[n_embd]`.
    NextnEnorm,
    NextnHnorm,
    /// MTP head: the norm before the output head, `[n_embd]`.
    NextnSharedHeadNorm,
    /// MTP head: its own embedding table and output head, `[n_embd, n_vocab]` (optional;
    /// Qwen's share the trunk's).
    NextnEmbedTokens,
    NextnSharedHeadHead,
}

impl Role {
    pub fn base(self) -> &'static str {
        match self {
            Role::TokenEmbd => "token_embd",
            Role::OutputNorm => "output_norm",
            Role::Output => "output",
            Role::AttnNorm => "attn_norm",
            Role::AttnQ => "attn_q",
            Role::AttnK => "attn_k",
            Role::AttnV => "attn_v",
            Role::AttnOut => "attn_output",
            Role::AttnQNorm => "attn_q_norm",
            Role::AttnKNorm => "attn_k_norm",
            Role::PostAttnNorm => "post_attention_norm",
            Role::AttnSinks => "attn_sinks",
            Role::FfnNorm => "ffn_norm",
            Role::PostFfwNorm => "post_ffw_norm",
            Role::RopeFreqs => "rope_freqs",
            Role::FfnGate => "ffn_gate",
            Role::FfnUp => "ffn_up",
            Role::FfnDown => "ffn_down",
            Role::FfnGateInp => "ffn_gate_inp",
            Role::FfnGateExps => "ffn_gate_exps",
            Role::FfnUpExps => "ffn_up_exps",
            Role::FfnDownExps => "ffn_down_exps",
            Role::FfnGateInpShexp => "ffn_gate_inp_shexp",
            Role::FfnGateShexp => "ffn_gate_shexp",
            Role::FfnUpShexp => "ffn_up_shexp",
            Role::FfnDownShexp => "ffn_down_shexp",
            Role::AttnQkv => "attn_qkv",
            Role::AttnGate => "attn_gate",
            Role::SsmConv1d => "ssm_conv1d",
            Role::SsmDt => "ssm_dt",
            Role::SsmA => "ssm_a",
            Role::SsmBeta => "ssm_beta",
            Role::SsmAlpha => "ssm_alpha",
            Role::SsmBa => "ssm_ba",
            Role::SsmIn => "ssm_in",
            Role::SsmNorm => "ssm_norm",
            Role::SsmOut => "ssm_out",
            Role::PerLayerTokenEmbd => "per_layer_token_embd",
            Role::PerLayerModelProj => "per_layer_model_proj",
            Role::PerLayerProjNorm => "per_layer_proj_norm",
            Role::InpGate => "inp_gate",
            Role::Proj => "proj",
            Role::PostNorm => "post_norm",
            Role::LayerOutputScale => "layer_output_scale",
            Role::PreFfwNorm2 => "pre_ffw_norm_2",
            Role::PostFfwNorm1 => "post_ffw_norm_1",
            Role::PostFfwNorm2 => "post_ffw_norm_2",
            Role::FfnGateUpExps => "ffn_gate_up_exps",
            Role::NextnEhProj => "nextn.eh_proj",
            Role::NextnEnorm => "nextn.enorm",
            Role::NextnHnorm => "nextn.hnorm",
            Role::NextnSharedHeadNorm => "nextn.shared_head_norm",
            Role::NextnEmbedTokens => "nextn.embed_tokens",
            Role::NextnSharedHeadHead => "nextn.shared_head_head",
        }
    }

    /// `blk.{layer}.{base}.{suffix}`, or `{base}.{suffix}` for model-level
    /// tensors; an empty suffix leaves the name bare (`ssm_a`).
    pub fn name(self, layer: Option<usize>, suffix: &str) -> String {
        let base = match layer {
            Some(l) => format!("blk.{l}.{}", self.base()),
            None => self.base().to_string(),
        };
        if suffix.is_empty() { base } else { format!("{base}.{suffix}") }
    }
}

/// Weights of a routed-expert FFN.
pub struct MoeWeights {
    /// `[n_embd, n_expert]`.
    pub router: Weight,
    /// `[n_expert]` (gpt-oss).
    pub router_bias: Option<Vec<f32>>,
    /// `[n_embd, n_ff_exp, n_expert]`.
    pub gate_exps: Weight,
    /// `[n_embd, n_ff_exp, n_expert]`.
    pub up_exps: Weight,
    /// `[n_ff_exp, n_embd, n_expert]`.
    pub down_exps: Weight,
    /// Per-expert biases, `[n_expert][n_ff_exp]` and `[n_expert][n_embd]` (gpt-oss).
    pub gate_bias: Option<Vec<f32>>,
    pub up_bias: Option<Vec<f32>>,
    pub down_bias: Option<Vec<f32>>,
    /// `[n_expert]`: each expert's output is scaled (Gemma 4; folded into its route weight).
    pub expert_scale: Option<Vec<f32>>,
    /// `[n_embd]`: the experts read `rmsnorm(x) · input_norm` instead of the FFN norm's output (Gemma 4).
    pub input_norm: Option<Vec<f32>>,
    /// `[n_embd]`: the router reads `rmsnorm(x) · router_norm` (Gemma 4: `ffn_gate_inp.scale / sqrt(n_embd)`).
    pub router_norm: Option<Vec<f32>>,
    /// `[n_embd]`: norm of the experts' sum (Gemma 4).
    pub output_norm: Option<Vec<f32>>,
    pub shared: Option<SharedExpertWeights>,
}

/// A dense FFN beside the routed experts, reading the FFN norm's output: a
/// shared expert, or Gemma 4's MLP.
pub struct SharedExpertWeights {
    /// `[n_embd, n_ff_sh]`, `[n_embd, n_ff_sh]`, `[n_ff_sh, n_embd]`.
    pub gate: Weight,
    pub up: Weight,
    pub down: Weight,
    /// `[n_embd]`: the output is scaled by `sigmoid(gate_inp · x)`.
    pub gate_inp: Option<Vec<f32>>,
    /// `[n_embd]`: norm of the output (Gemma 4).
    pub post_norm: Option<Vec<f32>>,
}

#[allow(clippy::large_enum_variant)] // one per layer; boxing buys nothing
pub enum Ffn {
    /// `[n_embd, n_ff]`, `[n_embd, n_ff]`, `[n_ff, n_embd]`.
    Dense {
        gate: Weight,
        up: Weight,
        down: Weight,
    },
    Moe(MoeWeights),
}

/// A softmax-attention mixer's weights. Small vectors (norms, biases, sinks) are f32.
pub struct AttnWeights {
    /// `[n_embd, q_dim]`, `[n_embd, kv_dim]`, `[n_embd, v_dim]`, `[q_dim, n_embd]`.
    /// A layer sharing an earlier layer's keys and values uses no k or v; a layer
    /// without a v projection takes V from the K projection (Gemma 4).
    pub wq: Weight,
    pub wk: Option<Weight>,
    pub wv: Option<Weight>,
    pub wo: Weight,
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    pub bo: Option<Vec<f32>>,
    /// `[head_dim]` per head, or `[q_dim]`/`[kv_dim]` for full-width norms.
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    /// `[n_head]` attention-sink logits (gpt-oss).
    pub sinks: Option<Vec<f32>>,
}

/// A Gated DeltaNet mixer's weights (docs/FAMILIES.md §6.2).
pub struct DeltaNetWeights {
    /// `[n_embd, conv_dim]`: q heads, k heads, v heads, before the convolution.
    pub qkv: Weight,
    /// `[n_embd, v_dim]`: z, the output gate.
    pub gate: Weight,
    /// `[n_embd, n_v_heads]` each: the projections giving beta and the decay.
    pub beta: Weight,
    pub alpha: Weight,
    /// `[conv_dim][conv_kernel]`: each channel's taps, the last one on the current input.
    pub conv: Vec<f32>,
    /// `[n_v_heads]`.
    pub dt_bias: Vec<f32>,
    /// `[n_v_heads]`: `-exp(A_log)`.
    pub a: Vec<f32>,
    /// `[d_v]`: the gated RMS norm's weight, shared by the heads.
    pub norm: Vec<f32>,
    /// `[v_dim, n_embd]`.
    pub out: Weight,
}

/// The weights of a layer's mixer, of the layer's kind.
#[allow(clippy::large_enum_variant)] // one per layer
pub enum MixerWeights {
    Attention(AttnWeights),
    DeltaNet(DeltaNetWeights),
}

impl MixerWeights {
    /// The weight matrices (not the small vectors).
    pub fn matrices(&self) -> Vec<&Weight> {
        match self {
            MixerWeights::Attention(a) => {
                [Some(&a.wq), a.wk.as_ref(), a.wv.as_ref(), Some(&a.wo)].into_iter().flatten().collect()
            }
            MixerWeights::DeltaNet(d) => vec![&d.qkv, &d.gate, &d.beta, &d.alpha, &d.out],
        }
    }
}

/// One block's weights. Small vectors (norms, biases) are f32.
pub struct LayerWeights {
    /// `[n_embd]`: the norm before the mixer.
    pub attn_norm: Vec<f32>,
    pub mixer: MixerWeights,
    /// gemma3: `[n_embd]` norm of the mixer's output.
    pub attn_post_norm: Option<Vec<f32>>,
    /// `[n_embd]`: the norm before the FFN.
    pub ffn_norm: Vec<f32>,
    /// gemma3: `[n_embd]` norm of the FFN output.
    pub ffn_post_norm: Option<Vec<f32>>,
    pub ffn: Ffn,
    /// Gemma 4's E models: what the layer adds from its per-layer input.
    pub per_layer: Option<PerLayerWeights>,
    /// Gemma 4: the residual stream is multiplied by this after the layer.
    pub output_scale: Option<f32>,
}

/// A layer's use of its per-layer input `pl` `[P]` (Gemma 4's E models):
/// `y += rmsnorm(proj · (gelu(inp_gate · y) ⊙ pl)) · post_norm`.
pub struct PerLayerWeights {
    /// `[n_embd, P]`.
    pub inp_gate: Weight,
    /// `[P, n_embd]`.
    pub proj: Weight,
    /// `[n_embd]`.
    pub post_norm: Vec<f32>,
}

/// The model-level tables of per-layer inputs (Gemma 4's E models): each
/// layer's `pl = (rmsnorm(model_proj · x / sqrt(n_embd)) · proj_norm + token_embd[tok] · sqrt(P)) / sqrt(2)`,
/// per `P`-wide slice.
pub struct PerLayerInputWeights {
    /// `[P·L, n_vocab]`.
    pub token_embd: Weight,
    /// `[n_embd, P·L]`.
    pub model_proj: Weight,
    /// `[P]`.
    pub proj_norm: Vec<f32>,
}

/// The multi-token-prediction ("nextn") head, GGUF block `n_layer` (docs/MTP.md §3): for the
/// trunk's final-normed hidden state `h` `[n_embd]` at position t and the token `x` at t + 1,
/// `u = eh_proj · [enorm(embed(x)); hnorm(h)]`, one decoder layer over its own cache,
/// `h' = shared_head_norm(layer(u))` and `logits = output · h'` (the guess for t + 2).
/// The GGUF's norms already hold Qwen's `1 + w`.
pub struct MtpWeights {
    /// `[n_embd, n_embd]` each: the columns of `eh_proj` `[2 n_embd, n_embd]` that read the
    /// normed embedding (its first half), and those that read the normed hidden state.
    pub eh_proj_embd: Weight,
    pub eh_proj_hidden: Weight,
    /// `[n_embd]`.
    pub enorm: Vec<f32>,
    /// `[n_embd]`.
    pub hnorm: Vec<f32>,
    /// `[n_embd]`.
    pub shared_head_norm: Vec<f32>,
    /// `[n_embd, n_vocab]`: the head's own embedding table and output head, where the
    /// file has them (else the trunk's `token_embd` and `output`).
    pub embed_tokens: Option<Weight>,
    pub head: Option<Weight>,
    /// The decoder layer: full attention and the trunk's kind of FFN ([`ArchConfig::nextn_layer`]).
    pub layer: LayerWeights,
}

pub struct ModelWeights {
    /// `[n_embd, n_vocab]`.
    pub token_embd: Weight,
    /// `[n_embd]`.
    pub output_norm: Vec<f32>,
    /// `[n_embd, n_vocab]`: `output.weight`, or the embedding table when tied.
    pub output: Weight,
    pub output_bias: Option<Vec<f32>>,
    /// `[n_rot / 2]`: each rotary frequency is divided by its factor (Llama 3 scaling).
    pub rope_freqs: Option<Vec<f32>>,
    pub per_layer_input: Option<PerLayerInputWeights>,
    pub layers: Vec<LayerWeights>,
    /// The multi-token-prediction head, where the file has one (`nextn_predict_layers` > 0).
    pub mtp: Option<MtpWeights>,
}

impl ModelWeights {
    /// Weight bytes one token reads at batch 1: every matrix once, one row of
    /// the embedding table, and `n_expert_used` experts of each MoE layer
    /// (small f32 vectors left out). Decode is bound by this over memory bandwidth.
    pub fn bytes_per_token(&self, n_expert_used: usize) -> u64 {
        let b = |w: &Weight| w.bytes().len() as u64;
        let matrix = |w: &Weight| (w.row_bytes() * w.n_rows()) as u64;
        let mut total = self.token_embd.row_bytes() as u64 + b(&self.output);
        if let Some(p) = &self.per_layer_input {
            total += p.token_embd.row_bytes() as u64 + b(&p.model_proj);
        }
        for l in &self.layers {
            total += l.mixer.matrices().into_iter().map(b).sum::<u64>();
            total += match &l.ffn {
                Ffn::Dense { gate, up, down } => b(gate) + b(up) + b(down),
                Ffn::Moe(m) => {
                    let expert = matrix(&m.gate_exps) + matrix(&m.up_exps) + matrix(&m.down_exps);
                    let shared = m.shared.as_ref().map_or(0, |s| b(&s.gate) + b(&s.up) + b(&s.down));
                    b(&m.router) + expert * n_expert_used as u64 + shared
                }
            };
            total += l.per_layer.as_ref().map_or(0, |p| b(&p.inp_gate) + b(&p.proj));
        }
        total
    }
}

/// Types a weight matrix may have: what the CPU matmul computes with.
fn matrix_type_ok(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(ty, F32 | F16 | BF16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | MXFP4)
}

/// Looks tensors up by name and checks each one's shape and type.
struct Loader<'a> {
    file: &'a Arc<GgufFile>,
    by_name: HashMap<&'a str, &'a ts_gguf::TensorInfo>,
}

impl Loader<'_> {
    fn find(&self, name: &str) -> Option<Weight> {
        self.by_name.get(name).map(|info| Weight::mapped(self.file, info))
    }

    /// Whether the file has the `.weight` of `role` (in `layer`).
    fn has(&self, role: Role, layer: Option<usize>) -> bool {
        self.by_name.contains_key(role.name(layer, "weight").as_str())
    }

    fn check(&self, w: &Weight, shape: &[usize], matrix: bool) -> Result<(), ModelError> {
        // Trailing dimensions of 1 are accepted ([n] and [n, 1] are the same vector).
        let trimmed = |d: &[usize]| d.iter().rposition(|&x| x != 1).map_or(0, |i| i + 1);
        if w.dims[..trimmed(&w.dims)] != shape[..trimmed(shape)] {
            return Err(ModelError::BadTensor {
                name: w.name.clone(),
                problem: format!("shape {:?}, expected {shape:?}", w.dims),
            });
        }
        let ok = if matrix { matrix_type_ok(w.ty) } else { ts_quant::is_supported(w.ty) };
        if !ok {
            return Err(ModelError::BadTensor {
                name: w.name.clone(),
                problem: format!("type {} is not supported for this role", w.ty),
            });
        }
        Ok(())
    }

    fn matrix(&self, role: Role, layer: Option<usize>, shape: &[usize]) -> Result<Weight, ModelError> {
        let name = role.name(layer, "weight");
        let w = self.find(&name).ok_or(ModelError::MissingTensor(name))?;
        self.check(&w, shape, true)?;
        Ok(w)
    }

    fn opt_matrix(&self, role: Role, layer: Option<usize>, shape: &[usize]) -> Result<Option<Weight>, ModelError> {
        let name = role.name(layer, "weight");
        self.find(&name).map(|w| self.check(&w, shape, true).map(|()| w)).transpose()
    }

    fn opt_vector(
        &self,
        role: Role,
        layer: Option<usize>,
        suffix: &str,
        shape: &[usize],
    ) -> Result<Option<Vec<f32>>, ModelError> {
        let name = role.name(layer, suffix);
        match self.find(&name) {
            None => Ok(None),
            Some(w) => {
                self.check(&w, shape, false)?;
                Ok(Some(w.to_f32()))
            }
        }
    }

    fn vector(&self, role: Role, layer: Option<usize>, suffix: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        self.opt_vector(role, layer, suffix, shape)?.ok_or_else(|| ModelError::MissingTensor(role.name(layer, suffix)))
    }

    fn required_if<T>(
        &self,
        needed: bool,
        v: Option<T>,
        role: Role,
        layer: usize,
        suffix: &str,
    ) -> Result<Option<T>, ModelError> {
        if needed && v.is_none() {
            return Err(ModelError::MissingTensor(role.name(Some(layer), suffix)));
        }
        Ok(v)
    }
}

impl ModelWeights {
    pub fn load(file: &Arc<GgufFile>, cfg: &ArchConfig) -> Result<ModelWeights, ModelError> {
        let by_name = file.tensors().iter().map(|t| (t.name.as_str(), t)).collect();
        let ld = Loader { file, by_name };
        let (e, v) = (cfg.n_embd, cfg.n_vocab);
        let token_embd = ld.matrix(Role::TokenEmbd, None, &[e, v])?;
        let output = match ld.opt_matrix(Role::Output, None, &[e, v])? {
            Some(w) => w,
            None if !cfg.family().tied_output => {
                return Err(ModelError::MissingTensor(Role::Output.name(None, "weight")));
            }
            None => token_embd.clone(),
        };
        let layers = (0..cfg.n_layer).map(|l| load_layer(&ld, cfg, l, &cfg.layers[l])).collect::<Result<_, _>>()?;
        let mtp = cfg.nextn_layer.as_ref().map(|plan| load_mtp(&ld, cfg, plan)).transpose()?;
        Ok(ModelWeights {
            output_norm: ld.vector(Role::OutputNorm, None, "weight", &[e])?,
            output_bias: ld.opt_vector(Role::Output, None, "bias", &[v])?,
            rope_freqs: match cfg.layers.iter().filter_map(|l| l.attention()).find(|a| a.rope_freq_factors) {
                Some(a) => ld.opt_vector(Role::RopeFreqs, None, "weight", &[a.rope.n_rot / 2])?,
                None => None,
            },
            per_layer_input: match cfg.per_layer_input {
                0 => None,
                p => Some(PerLayerInputWeights {
                    token_embd: ld.matrix(Role::PerLayerTokenEmbd, None, &[p * cfg.n_layer, v])?,
                    model_proj: ld.matrix(Role::PerLayerModelProj, None, &[e, p * cfg.n_layer])?,
                    proj_norm: ld.vector(Role::PerLayerProjNorm, None, "weight", &[p])?,
                }),
            },
            token_embd,
            output,
            layers,
            mtp,
        })
    }
}

/// The MTP head of block `n_layer`: a file that declares `nextn_predict_layers` but lacks a
/// tensor of it fails to open, naming the tensor.
fn load_mtp(ld: &Loader, cfg: &ArchConfig, plan: &LayerConfig) -> Result<MtpWeights, ModelError> {
    let (e, v, l) = (cfg.n_embd, cfg.n_vocab, cfg.n_layer);
    let il = Some(l);
    let eh_proj = ld.matrix(Role::NextnEhProj, il, &[2 * e, e])?;
    let half = |first: usize, part: &str| {
        eh_proj
            .select_columns(&format!("{} ({part})", eh_proj.name), first, e)
            .map_err(|problem| ModelError::BadTensor { name: eh_proj.name.clone(), problem })
    };
    Ok(MtpWeights {
        eh_proj_embd: half(0, "embedding columns")?,
        eh_proj_hidden: half(e, "hidden columns")?,
        enorm: ld.vector(Role::NextnEnorm, il, "weight", &[e])?,
        hnorm: ld.vector(Role::NextnHnorm, il, "weight", &[e])?,
        shared_head_norm: ld.vector(Role::NextnSharedHeadNorm, il, "weight", &[e])?,
        embed_tokens: ld.opt_matrix(Role::NextnEmbedTokens, il, &[e, v])?,
        head: ld.opt_matrix(Role::NextnSharedHeadHead, il, &[e, v])?,
        layer: load_layer(ld, cfg, l, plan)?,
    })
}

/// Block `l`'s weights, laid out as `plan` says.
fn load_layer(ld: &Loader, cfg: &ArchConfig, l: usize, plan: &LayerConfig) -> Result<LayerWeights, ModelError> {
    let e = cfg.n_embd;
    let il = Some(l);
    let mixer = match &plan.mixer {
        Mixer::Attention(a) => MixerWeights::Attention(load_attention(ld, cfg, l, a)?),
        Mixer::DeltaNet => MixerWeights::DeltaNet(load_delta_net(ld, cfg, l)?),
    };
    Ok(LayerWeights {
        attn_norm: ld.vector(Role::AttnNorm, il, "weight", &[e])?,
        mixer,
        attn_post_norm: if cfg.post_norms { Some(ld.vector(Role::PostAttnNorm, il, "weight", &[e])?) } else { None },
        ffn_norm: ld.vector(cfg.family().ffn_norm, il, "weight", &[e])?,
        ffn_post_norm: if cfg.post_norms { Some(ld.vector(Role::PostFfwNorm, il, "weight", &[e])?) } else { None },
        ffn: load_ffn(ld, cfg, l, plan)?,
        per_layer: match cfg.per_layer_input {
            0 => None,
            p => Some(PerLayerWeights {
                inp_gate: ld.matrix(Role::InpGate, il, &[e, p])?,
                proj: ld.matrix(Role::Proj, il, &[p, e])?,
                post_norm: ld.vector(Role::PostNorm, il, "weight", &[e])?,
            }),
        },
        output_scale: ld.opt_vector(Role::LayerOutputScale, il, "weight", &[1])?.map(|s| s[0]),
    })
}

fn load_attention(ld: &Loader, cfg: &ArchConfig, l: usize, a: &AttnLayer) -> Result<AttnWeights, ModelError> {
    let (e, q, kv, vd) = (cfg.n_embd, cfg.n_head * a.head_dim, a.kv_dim(), a.v_dim());
    let il = Some(l);
    let fam = cfg.family();
    let shared = a.kv_from.is_some();
    let (q_norm_dim, k_norm_dim) = match cfg.qk_norm {
        QkNorm::PerHead => (a.head_dim, a.head_dim),
        QkNorm::Full => (q, kv),
        QkNorm::None => (0, 0),
    };
    let has_qk_norm = cfg.qk_norm != QkNorm::None;
    let bias = |role: Role, needed: bool, width: usize| -> Result<Option<Vec<f32>>, ModelError> {
        ld.required_if(needed, ld.opt_vector(role, il, "bias", &[width])?, role, l, "bias")
    };
    let norm = |role: Role, needed: bool, width: usize| -> Result<Option<Vec<f32>>, ModelError> {
        let v = ld.opt_vector(role, il, "weight", &[width])?.filter(|_| has_qk_norm);
        ld.required_if(needed && has_qk_norm, v, role, l, "weight")
    };
    // A gated attention's query projection holds per head [q | gate].
    let q_out = if cfg.attn_output_gate { 2 * q } else { q };
    // A layer that shares an earlier layer's keys and values needs no k or v of its own
    // (Gemma 4's files may hold unused ones); Gemma 4's global layers may have no v.
    let wk = match shared {
        true => None,
        false => Some(ld.matrix(Role::AttnK, il, &[e, kv])?),
    };
    let wv = match shared {
        true => None,
        false if fam.v_norm => ld.opt_matrix(Role::AttnV, il, &[e, vd])?,
        false => Some(ld.matrix(Role::AttnV, il, &[e, vd])?),
    };
    if wv.is_none() && !shared && a.head_dim_v != a.head_dim {
        return Err(ModelError::MissingTensor(Role::AttnV.name(il, "weight")));
    }
    Ok(AttnWeights {
        wq: ld.matrix(Role::AttnQ, il, &[e, q_out])?,
        wk,
        wv,
        wo: ld.matrix(Role::AttnOut, il, &[cfg.n_head * a.head_dim_v, e])?,
        bq: bias(Role::AttnQ, fam.qkv_bias, q)?,
        bk: bias(Role::AttnK, fam.qkv_bias && !shared, kv)?,
        bv: bias(Role::AttnV, fam.qkv_bias && !shared, vd)?,
        bo: bias(Role::AttnOut, fam.out_bias, e)?,
        q_norm: norm(Role::AttnQNorm, true, q_norm_dim)?,
        k_norm: norm(Role::AttnKNorm, !shared, k_norm_dim)?,
        sinks: if cfg.attn_sinks { Some(ld.vector(Role::AttnSinks, il, "weight", &[cfg.n_head])?) } else { None },
    })
}

fn load_delta_net(ld: &Loader, cfg: &ArchConfig, l: usize) -> Result<DeltaNetWeights, ModelError> {
    let d = cfg.delta_net.as_ref().expect("a delta-net layer has its config");
    let (e, nv, kk) = (cfg.n_embd, d.n_v_heads, d.conv_kernel);
    let il = Some(l);
    let (beta, alpha) = match cfg.arch {
        // Rows of ssm_ba per key head g: its r betas, then its r alphas (src/models/qwen3next.cpp).
        Arch::Qwen3Next => {
            let ba = ld.matrix(Role::SsmBa, il, &[e, 2 * nv])?;
            let r = nv / d.n_k_heads;
            let rows =
                |second: usize| -> Vec<usize> { (0..nv).map(|h| 2 * r * (h / r) + second * r + h % r).collect() };
            (ba.select_rows("ssm_beta", &rows(0)), ba.select_rows("ssm_alpha", &rows(1)))
        }
        _ => (ld.matrix(Role::SsmBeta, il, &[e, nv])?, ld.matrix(Role::SsmAlpha, il, &[e, nv])?),
    };
    // ggml [conv_kernel, conv_dim]: each channel's taps are contiguous.
    let conv = ld.vector(Role::SsmConv1d, il, "weight", &[kk, d.conv_dim()])?;
    let legacy = cfg.arch == Arch::Qwen3Next && !ld.has(Role::AttnQkv, il) && ld.has(Role::SsmIn, il);
    let (qkv, gate) = match legacy {
        true => split_qkvz(&ld.matrix(Role::SsmIn, il, &[e, d.conv_dim() + d.v_dim()])?, d),
        false => (ld.matrix(Role::AttnQkv, il, &[e, d.conv_dim()])?, ld.matrix(Role::AttnGate, il, &[e, d.v_dim()])?),
    };
    Ok(DeltaNetWeights {
        qkv,
        gate,
        beta,
        alpha,
        conv,
        dt_bias: ld.vector(Role::SsmDt, il, "bias", &[nv])?,
        a: ld.vector(Role::SsmA, il, "", &[nv])?,
        norm: ld.vector(Role::SsmNorm, il, "weight", &[d.d_v])?,
        out: ld.matrix(Role::SsmOut, il, &[d.v_dim(), e])?,
    })
}

/// qwen3next's fused `ssm_in` (older converters: Hugging Face's `in_proj_qkvz`),
/// whose rows come per key head g in blocks of `2 d_k + 2 r d_v`: q_g, k_g, then
/// the r value heads of g, then their r z heads (`src/models/qwen3next.cpp:
/// build_qkvz`), as `attn_qkv` (all q, all k, all v) and `attn_gate` (all z).
fn split_qkvz(w: &Weight, d: &DeltaNetConfig) -> (Weight, Weight) {
    let (nk, dk, dv) = (d.n_k_heads, d.d_k, d.d_v);
    let r = d.n_v_heads / nk;
    let block = 2 * dk + 2 * r * dv;
    let q = (0..nk).flat_map(|g| (0..dk).map(move |i| g * block + i));
    let k = (0..nk).flat_map(|g| (0..dk).map(move |i| g * block + dk + i));
    let v = (0..nk).flat_map(|g| (0..r * dv).map(move |i| g * block + 2 * dk + i));
    let z = (0..nk).flat_map(|g| (0..r * dv).map(move |i| g * block + 2 * dk + r * dv + i));
    let qkv: Vec<usize> = q.chain(k).chain(v).collect();
    let z: Vec<usize> = z.collect();
    (
        w.select_rows(&w.name.replace("ssm_in", "attn_qkv"), &qkv),
        w.select_rows(&w.name.replace("ssm_in", "attn_gate"), &z),
    )
}

fn load_ffn(ld: &Loader, cfg: &ArchConfig, l: usize, plan: &LayerConfig) -> Result<Ffn, ModelError> {
    let e = cfg.n_embd;
    let il = Some(l);
    let dense = |f: usize| -> Result<(Weight, Weight, Weight), ModelError> {
        Ok((
            ld.matrix(Role::FfnGate, il, &[e, f])?,
            ld.matrix(Role::FfnUp, il, &[e, f])?,
            ld.matrix(Role::FfnDown, il, &[f, e])?,
        ))
    };
    let moe = match &cfg.moe {
        Some(moe) if plan.moe => moe,
        _ => {
            let (gate, up, down) = dense(plan.n_ff)?;
            return Ok(Ffn::Dense { gate, up, down });
        }
    };
    let (n, f) = (moe.n_expert, moe.n_ff_exp);
    let wiring = cfg.family().moe.expect("a MoE config implies the family's MoE wiring");
    let expert_bias = |role: Role, width: usize| -> Result<Option<Vec<f32>>, ModelError> {
        let b = ld.opt_vector(role, il, "bias", &[width, n])?;
        ld.required_if(wiring.biases, b, role, l, "bias")
    };
    let norm = |role: Role| -> Result<Option<Vec<f32>>, ModelError> {
        wiring.beside_dense.then(|| ld.vector(role, il, "weight", &[e])).transpose()
    };
    let shared = match (moe.shared, wiring.beside_dense) {
        (Some(sh), _) => Some(SharedExpertWeights {
            gate: ld.matrix(Role::FfnGateShexp, il, &[e, sh.n_ff])?,
            up: ld.matrix(Role::FfnUpShexp, il, &[e, sh.n_ff])?,
            down: ld.matrix(Role::FfnDownShexp, il, &[sh.n_ff, e])?,
            gate_inp: if sh.sigmoid_gated { Some(ld.vector(Role::FfnGateInpShexp, il, "weight", &[e])?) } else { None },
            post_norm: None,
        }),
        (None, true) => {
            let (gate, up, down) = dense(plan.n_ff)?;
            Some(SharedExpertWeights { gate, up, down, gate_inp: None, post_norm: norm(Role::PostFfwNorm1)? })
        }
        (None, false) => None,
    };
    // Gate and up may come as the halves of one tensor, gate rows first (Gemma 4).
    let (gate_exps, up_exps) = match ld.opt_matrix(Role::FfnGateUpExps, il, &[e, 2 * f, n])? {
        Some(fused) => (
            fused.matrix_rows(&Role::FfnGateExps.name(il, "weight"), 0, f),
            fused.matrix_rows(&Role::FfnUpExps.name(il, "weight"), f, f),
        ),
        None => (ld.matrix(Role::FfnGateExps, il, &[e, f, n])?, ld.matrix(Role::FfnUpExps, il, &[e, f, n])?),
    };
    // The router reads a weightless norm scaled by `scale / sqrt(n_embd)` (Gemma 4).
    let router_norm = wiring
        .beside_dense
        .then(|| ld.vector(Role::FfnGateInp, il, "scale", &[e]))
        .transpose()?
        .map(|scale| scale.iter().map(|s| s / (e as f32).sqrt()).collect());
    Ok(Ffn::Moe(MoeWeights {
        router: ld.matrix(Role::FfnGateInp, il, &[e, n])?,
        router_bias: ld.required_if(
            wiring.biases,
            ld.opt_vector(Role::FfnGateInp, il, "bias", &[n])?,
            Role::FfnGateInp,
            l,
            "bias",
        )?,
        gate_exps,
        up_exps,
        down_exps: ld.matrix(Role::FfnDownExps, il, &[f, e, n])?,
        gate_bias: expert_bias(Role::FfnGateExps, f)?,
        up_bias: expert_bias(Role::FfnUpExps, f)?,
        down_bias: expert_bias(Role::FfnDownExps, e)?,
        expert_scale: ld.opt_vector(Role::FfnDownExps, il, "scale", &[n])?,
        input_norm: norm(Role::PreFfwNorm2)?,
        router_norm,
        output_norm: norm(Role::PostFfwNorm2)?,
        shared,
    }))
}

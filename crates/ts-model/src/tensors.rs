//! The one tensor-name table, and the model's weights gathered and validated
//! at open: every tensor a family needs is present, of a type the engine can
//! compute with, and of the right shape, or the open fails naming it.

use crate::ModelError;
use crate::config::{Arch, ArchConfig, QkNorm};
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
        }
    }

    /// `blk.{layer}.{base}.{suffix}`, or `{base}.{suffix}` for model-level tensors.
    pub fn name(self, layer: Option<usize>, suffix: &str) -> String {
        match layer {
            Some(l) => format!("blk.{l}.{}.{suffix}", self.base()),
            None => format!("{}.{suffix}", self.base()),
        }
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
    pub shared: Option<SharedExpertWeights>,
}

pub struct SharedExpertWeights {
    /// `[n_embd, n_ff_sh]`, `[n_embd, n_ff_sh]`, `[n_ff_sh, n_embd]`.
    pub gate: Weight,
    pub up: Weight,
    pub down: Weight,
    /// `[n_embd]`: the output is scaled by `sigmoid(gate_inp · x)`.
    pub gate_inp: Option<Vec<f32>>,
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

/// One transformer block's weights. Small vectors (norms, biases, sinks) are f32.
pub struct LayerWeights {
    /// `[n_embd]`.
    pub attn_norm: Vec<f32>,
    /// `[n_embd, q_dim]`, `[n_embd, kv_dim]`, `[n_embd, v_dim]`, `[q_dim, n_embd]`.
    pub wq: Weight,
    pub wk: Weight,
    pub wv: Weight,
    pub wo: Weight,
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    pub bo: Option<Vec<f32>>,
    /// `[head_dim]` per head, or `[q_dim]`/`[kv_dim]` for full-width norms.
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    /// gemma3: `[n_embd]` norm of the attention output.
    pub attn_post_norm: Option<Vec<f32>>,
    /// `[n_head]` attention-sink logits (gpt-oss).
    pub sinks: Option<Vec<f32>>,
    /// `[n_embd]`: the norm before the FFN.
    pub ffn_norm: Vec<f32>,
    /// gemma3: `[n_embd]` norm of the FFN output.
    pub ffn_post_norm: Option<Vec<f32>>,
    pub ffn: Ffn,
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
    pub layers: Vec<LayerWeights>,
}

impl ModelWeights {
    /// Weight bytes one token reads at batch 1: every matrix once, one row of
    /// the embedding table, and `n_expert_used` experts of each MoE layer
    /// (small f32 vectors left out). Decode is bound by this over memory bandwidth.
    pub fn bytes_per_token(&self, n_expert_used: usize) -> u64 {
        let b = |w: &Weight| w.bytes().len() as u64;
        let mut total = self.token_embd.row_bytes() as u64 + b(&self.output);
        for l in &self.layers {
            total += b(&l.wq) + b(&l.wk) + b(&l.wv) + b(&l.wo);
            total += match &l.ffn {
                Ffn::Dense { gate, up, down } => b(gate) + b(up) + b(down),
                Ffn::Moe(m) => {
                    let n_expert = m.gate_exps.dims.get(2).copied().unwrap_or(1).max(1) as u64;
                    let experts = (b(&m.gate_exps) + b(&m.up_exps) + b(&m.down_exps)) / n_expert;
                    let shared = m.shared.as_ref().map_or(0, |s| b(&s.gate) + b(&s.up) + b(&s.down));
                    b(&m.router) + experts * n_expert_used as u64 + shared
                }
            };
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
            None if matches!(cfg.arch, Arch::Qwen2Moe | Arch::Olmoe | Arch::GptOss) => {
                return Err(ModelError::MissingTensor(Role::Output.name(None, "weight")));
            }
            None => token_embd.clone(),
        };
        let layers = (0..cfg.n_layer).map(|l| load_layer(&ld, cfg, l)).collect::<Result<_, _>>()?;
        Ok(ModelWeights {
            output_norm: ld.vector(Role::OutputNorm, None, "weight", &[e])?,
            output_bias: ld.opt_vector(Role::Output, None, "bias", &[v])?,
            rope_freqs: ld.opt_vector(Role::RopeFreqs, None, "weight", &[cfg.layers[0].rope.n_rot / 2])?,
            token_embd,
            output,
            layers,
        })
    }
}

fn load_layer(ld: &Loader, cfg: &ArchConfig, l: usize) -> Result<LayerWeights, ModelError> {
    let (e, q, kv, vd) = (cfg.n_embd, cfg.q_dim(), cfg.kv_dim(), cfg.v_dim());
    let il = Some(l);
    let biased = matches!(cfg.arch, Arch::Qwen2 | Arch::Qwen2Moe | Arch::GptOss);
    let (q_norm_dim, k_norm_dim) = match cfg.qk_norm {
        QkNorm::PerHead => (cfg.head_dim, cfg.head_dim),
        QkNorm::Full => (q, kv),
        QkNorm::None => (0, 0),
    };
    let has_qk_norm = cfg.qk_norm != QkNorm::None;
    let gpt_oss = cfg.arch == Arch::GptOss;
    Ok(LayerWeights {
        attn_norm: ld.vector(Role::AttnNorm, il, "weight", &[e])?,
        wq: ld.matrix(Role::AttnQ, il, &[e, q])?,
        wk: ld.matrix(Role::AttnK, il, &[e, kv])?,
        wv: ld.matrix(Role::AttnV, il, &[e, vd])?,
        wo: ld.matrix(Role::AttnOut, il, &[cfg.n_head * cfg.head_dim_v, e])?,
        bq: ld.required_if(biased, ld.opt_vector(Role::AttnQ, il, "bias", &[q])?, Role::AttnQ, l, "bias")?,
        bk: ld.required_if(biased, ld.opt_vector(Role::AttnK, il, "bias", &[kv])?, Role::AttnK, l, "bias")?,
        bv: ld.required_if(biased, ld.opt_vector(Role::AttnV, il, "bias", &[vd])?, Role::AttnV, l, "bias")?,
        bo: ld.required_if(gpt_oss, ld.opt_vector(Role::AttnOut, il, "bias", &[e])?, Role::AttnOut, l, "bias")?,
        q_norm: ld.required_if(
            has_qk_norm,
            ld.opt_vector(Role::AttnQNorm, il, "weight", &[q_norm_dim])?.filter(|_| has_qk_norm),
            Role::AttnQNorm,
            l,
            "weight",
        )?,
        k_norm: ld.required_if(
            has_qk_norm,
            ld.opt_vector(Role::AttnKNorm, il, "weight", &[k_norm_dim])?.filter(|_| has_qk_norm),
            Role::AttnKNorm,
            l,
            "weight",
        )?,
        attn_post_norm: if cfg.post_norms { Some(ld.vector(Role::PostAttnNorm, il, "weight", &[e])?) } else { None },
        sinks: if cfg.attn_sinks { Some(ld.vector(Role::AttnSinks, il, "weight", &[cfg.n_head])?) } else { None },
        // gpt-oss names its pre-FFN norm post_attention_norm.
        ffn_norm: ld.vector(if gpt_oss { Role::PostAttnNorm } else { Role::FfnNorm }, il, "weight", &[e])?,
        ffn_post_norm: if cfg.post_norms { Some(ld.vector(Role::PostFfwNorm, il, "weight", &[e])?) } else { None },
        ffn: load_ffn(ld, cfg, l)?,
    })
}

fn load_ffn(ld: &Loader, cfg: &ArchConfig, l: usize) -> Result<Ffn, ModelError> {
    let e = cfg.n_embd;
    let il = Some(l);
    let Some(moe) = &cfg.moe else {
        let f = cfg.n_ff;
        return Ok(Ffn::Dense {
            gate: ld.matrix(Role::FfnGate, il, &[e, f])?,
            up: ld.matrix(Role::FfnUp, il, &[e, f])?,
            down: ld.matrix(Role::FfnDown, il, &[f, e])?,
        });
    };
    let (n, f) = (moe.n_expert, moe.n_ff_exp);
    let gpt_oss = cfg.arch == Arch::GptOss;
    let expert_bias = |role: Role, width: usize| -> Result<Option<Vec<f32>>, ModelError> {
        let b = ld.opt_vector(role, il, "bias", &[width, n])?;
        ld.required_if(gpt_oss, b, role, l, "bias")
    };
    let shared = match moe.shared {
        None => None,
        Some(sh) => Some(SharedExpertWeights {
            gate: ld.matrix(Role::FfnGateShexp, il, &[e, sh.n_ff])?,
            up: ld.matrix(Role::FfnUpShexp, il, &[e, sh.n_ff])?,
            down: ld.matrix(Role::FfnDownShexp, il, &[sh.n_ff, e])?,
            gate_inp: if sh.sigmoid_gated { Some(ld.vector(Role::FfnGateInpShexp, il, "weight", &[e])?) } else { None },
        }),
    };
    Ok(Ffn::Moe(MoeWeights {
        router: ld.matrix(Role::FfnGateInp, il, &[e, n])?,
        router_bias: ld.required_if(
            gpt_oss,
            ld.opt_vector(Role::FfnGateInp, il, "bias", &[n])?,
            Role::FfnGateInp,
            l,
            "bias",
        )?,
        gate_exps: ld.matrix(Role::FfnGateExps, il, &[e, f, n])?,
        up_exps: ld.matrix(Role::FfnUpExps, il, &[e, f, n])?,
        down_exps: ld.matrix(Role::FfnDownExps, il, &[f, e, n])?,
        gate_bias: expert_bias(Role::FfnGateExps, f)?,
        up_bias: expert_bias(Role::FfnUpExps, f)?,
        down_bias: expert_bias(Role::FfnDownExps, e)?,
        shared,
    }))
}

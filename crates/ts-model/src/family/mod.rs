//! Each family's wiring, one file per family, in the manner of llama.cpp's
//! `src/models/*.cpp`: which shared blocks it uses and in what order, the
//! defaults its GGUF leaves out, and where its tensor names differ. The forward
//! pass and the loaders read these facts from here and nowhere else
//! (docs/FAMILIES.md cites llama.cpp and transformers for each).

mod gemma3;
mod gemma4;
mod gpt_oss;
mod llama;
mod olmoe;
mod qwen2;
mod qwen2moe;
mod qwen3;
mod qwen35moe;
mod qwen3moe;
mod qwen3next;

use crate::ModelError;
use crate::config::{ArchConfig, DeltaNetConfig, GatedActivation, Gating, KeyHeadOf, Keys, Mixer, QkNorm, RopeLayout};
use crate::tensors::Role;

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
    /// Qwen3.5 MoE: Gated DeltaNet and gated attention layers.
    Qwen35Moe,
    /// Qwen3-Next: the same blocks, another head order.
    Qwen3Next,
    /// Gemma 4, dense and MoE.
    Gemma4,
}

impl Arch {
    pub const ALL: [Arch; 11] = [
        Arch::Llama,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Gemma3,
        Arch::Qwen2Moe,
        Arch::Qwen3Moe,
        Arch::Olmoe,
        Arch::GptOss,
        Arch::Qwen35Moe,
        Arch::Qwen3Next,
        Arch::Gemma4,
    ];

    /// The family's wiring.
    pub fn family(self) -> &'static Family {
        match self {
            Arch::Llama => &llama::FAMILY,
            Arch::Qwen2 => &qwen2::FAMILY,
            Arch::Qwen3 => &qwen3::FAMILY,
            Arch::Gemma3 => &gemma3::FAMILY,
            Arch::Qwen2Moe => &qwen2moe::FAMILY,
            Arch::Qwen3Moe => &qwen3moe::FAMILY,
            Arch::Olmoe => &olmoe::FAMILY,
            Arch::GptOss => &gpt_oss::FAMILY,
            Arch::Qwen35Moe => &qwen35moe::FAMILY,
            Arch::Qwen3Next => &qwen3next::FAMILY,
            Arch::Gemma4 => &gemma4::FAMILY,
        }
    }

    /// The `general.architecture` string.
    pub fn gguf_name(self) -> &'static str {
        self.family().gguf_name
    }

    pub fn from_gguf_name(name: &str) -> Result<Arch, ModelError> {
        Arch::ALL.into_iter().find(|a| a.gguf_name() == name).ok_or_else(|| {
            let known: Vec<&str> = Arch::ALL.iter().map(|a| a.gguf_name()).collect();
            ModelError::UnknownArchitecture { name: name.into(), known: known.join(", ") }
        })
    }
}

/// Sliding-window layers by default, when the file sets a window.
#[derive(Clone, Copy, Debug)]
pub struct Sliding {
    /// Every `period`-th layer is global, the others local (llama.cpp's `set_swa_pattern`),
    /// unless the file gives `attention.sliding_window_pattern`.
    pub period: usize,
    /// The file must give `attention.sliding_window`.
    pub window_required: bool,
    /// Rotary settings of the local layers.
    pub local_rope: LocalRope,
}

#[derive(Clone, Copy, Debug)]
pub enum LocalRope {
    /// `rope.freq_base_swa` (default `default_base`), no frequency scaling (gemma3).
    OwnBaseUnscaled { default_base: f32 },
    /// `rope.freq_base_swa` (default the global base), the global scaling (gpt-oss).
    OwnBase,
}

/// Where a routed expert's hidden width comes from.
#[derive(Clone, Copy, Debug)]
pub enum ExpertWidth {
    /// `feed_forward_length` (Mixtral, OLMoE).
    DenseWidth,
    /// `expert_feed_forward_length`, else `feed_forward_length / expert_used_count`.
    KeyOrShare,
    /// `expert_feed_forward_length`, required.
    Key,
}

/// How a family's MoE FFN is wired.
#[derive(Clone, Copy, Debug)]
pub struct MoeWiring {
    /// Every layer is MoE (else only files with `expert_count` > 0 are).
    pub required: bool,
    pub gating: Gating,
    /// Divide the k selected weights by their sum.
    pub renormalize: bool,
    pub expert_width: ExpertWidth,
    /// A shared expert scaled by `sigmoid(ffn_gate_inp_shexp · x)` beside the routed ones.
    pub gated_shared_expert: bool,
    /// Router and per-expert biases (gpt-oss).
    pub biases: bool,
    /// A dense MLP runs beside the experts, each with its own norms, the router
    /// reading a scaled norm of the layer's input and each expert's output scaled
    /// (Gemma 4's MoE).
    pub beside_dense: bool,
}

/// A family's wiring: the shared blocks it uses, the defaults its GGUF leaves
/// out, and its tensor-name exceptions.
#[derive(Clone, Copy, Debug)]
pub struct Family {
    pub arch: Arch,
    /// `general.architecture`.
    pub gguf_name: &'static str,
    pub rope_layout: RopeLayout,
    pub qk_norm: QkNorm,
    /// q, k and v projections have biases (required).
    pub qkv_bias: bool,
    /// The output projection has a bias (required).
    pub out_bias: bool,
    /// One learned logit per query head joins each attention softmax.
    pub attn_sinks: bool,
    /// Norms after attention and after the FFN, before each residual add.
    pub post_norms: bool,
    /// Values RMS-normalised per head without a weight (Gemma 4).
    pub v_norm: bool,
    pub ffn_act: GatedActivation,
    /// Token embeddings multiplied by `sqrt(n_embd)`.
    pub scale_embeddings: bool,
    /// Reads `final_logit_softcapping`.
    pub final_softcap: bool,
    /// `output.weight` may be absent: the embedding table is the output head.
    pub tied_output: bool,
    /// The tensor of the norm before the FFN.
    pub ffn_norm: Role,
    pub sliding: Option<Sliding>,
    /// YaRN ramp bounds rounded to whole dimensions (llama.cpp always rounds; gpt-oss's
    /// reference does not).
    pub yarn_truncate: bool,
    pub moe: Option<MoeWiring>,
    /// Family-specific settings read after the common ones.
    pub finish: fn(&Keys, &mut ArchConfig) -> Result<(), ModelError>,
}

impl Family {
    /// A pre-norm transformer with SwiGLU and no extras; each family's file
    /// states what differs.
    pub const BASE: Family = Family {
        arch: Arch::Llama,
        gguf_name: "",
        rope_layout: RopeLayout::Halves,
        qk_norm: QkNorm::None,
        qkv_bias: false,
        out_bias: false,
        attn_sinks: false,
        post_norms: false,
        v_norm: false,
        ffn_act: GatedActivation::SwiGlu,
        scale_embeddings: false,
        final_softcap: false,
        tied_output: true,
        ffn_norm: Role::FfnNorm,
        sliding: None,
        yarn_truncate: true,
        moe: None,
        finish: |_, _| Ok(()),
    };
}

/// What qwen35moe and qwen3next share: per-head q/k norms, the pre-FFN norm named
/// `post_attention_norm`, softmax routing renormalised over the top k, a
/// sigmoid-gated shared expert; each adds its arch and its layer layout.
pub(crate) const QWEN_HYBRID: Family = Family {
    qk_norm: QkNorm::PerHead,
    ffn_norm: Role::PostAttnNorm,
    moe: Some(MoeWiring {
        required: true,
        gating: Gating::Softmax,
        renormalize: true,
        expert_width: ExpertWidth::KeyOrShare,
        gated_shared_expert: true,
        biases: false,
        beside_dense: false,
    }),
    ..Family::BASE
};

/// The hybrid layout of qwen35moe and qwen3next: Gated DeltaNet layers with
/// `ssm.*` shapes, and every `full_attention_interval`-th layer (or those the
/// `attention.recurrent_layers` flags leave out) softmax attention with an
/// output gate (`src/models/qwen3next.cpp: load_arch_hparams`; docs/FAMILIES.md §6.1).
pub(crate) fn hybrid_layers(k: &Keys, cfg: &mut ArchConfig, key_head_of: KeyHeadOf) -> Result<(), ModelError> {
    let n_k_heads = k.req_usize("ssm.group_count")?;
    let n_v_heads = k.req_usize("ssm.time_step_rank")?;
    let d_k = k.req_usize("ssm.state_size")?;
    let inner = k.req_usize("ssm.inner_size")?;
    let conv_kernel = k.req_usize("ssm.conv_kernel")?;
    let bad = |key: &str, problem: String| ModelError::BadKey { key: k.name(key), problem };
    if n_k_heads == 0 || n_v_heads == 0 || n_v_heads % n_k_heads != 0 {
        return Err(bad("ssm.time_step_rank", format!("{n_v_heads} value heads for {n_k_heads} key heads")));
    }
    if inner != n_v_heads * d_k {
        // llama.cpp sizes the tensors with d_v = state_size and asserts d_k == d_v.
        return Err(bad("ssm.inner_size", format!("{inner} is not {n_v_heads} value heads of {d_k}")));
    }
    if conv_kernel < 2 {
        return Err(bad("ssm.conv_kernel", format!("{conv_kernel} must be at least 2")));
    }
    let recurrent: Vec<bool> = match k.flags("attention.recurrent_layers", cfg.n_layer)? {
        Some(flags) => flags,
        None => {
            let interval = k.usize("full_attention_interval")?.unwrap_or(4);
            if interval == 0 {
                return Err(bad("full_attention_interval", "must be non-zero".into()));
            }
            (0..cfg.n_layer).map(|il| (il + 1) % interval != 0).collect()
        }
    };
    for (l, recurrent) in cfg.layers.iter_mut().zip(recurrent) {
        if recurrent {
            l.mixer = Mixer::DeltaNet;
        }
    }
    cfg.delta_net = Some(DeltaNetConfig { n_k_heads, n_v_heads, d_k, d_v: d_k, conv_kernel, key_head_of });
    cfg.attn_output_gate = true;
    Ok(())
}

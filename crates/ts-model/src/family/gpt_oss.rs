//! gpt-oss (`src/models/openai-moe.cpp`): biases on every projection, attention
//! sinks, even layers sliding, YaRN without rounded ramp bounds, top-k of the
//! biased router logits then softmax over those k, clamped SwiGLU. Its pre-FFN
//! norm is named `post_attention_norm`.

use super::{Arch, ExpertWidth, Family, LocalRope, MoeWiring, Sliding};
use crate::config::{GatedActivation, Gating};
use crate::tensors::Role;

pub const FAMILY: Family = Family {
    arch: Arch::GptOss,
    gguf_name: "gpt-oss",
    qkv_bias: true,
    out_bias: true,
    attn_sinks: true,
    ffn_act: GatedActivation::SwiGluClamped { alpha: 1.702, limit: 7.0 },
    tied_output: false,
    ffn_norm: Role::PostAttnNorm,
    sliding: Some(Sliding { period: 2, window_required: true, local_rope: LocalRope::OwnBase }),
    yarn_truncate: false,
    moe: Some(MoeWiring {
        required: true,
        gating: Gating::SoftmaxOverTopK,
        renormalize: false,
        expert_width: ExpertWidth::Key,
        gated_shared_expert: false,
        biases: true,
        beside_dense: false,
    }),
    ..Family::BASE
};

//! Qwen3-Next (`src/models/qwen3next.cpp`): the blocks of qwen35moe with value
//! heads in Hugging Face's order (value head h reads key head h / (n_v / n_k))
//! and beta and alpha in one projection, `ssm_ba`, grouped by key head.

use super::{Arch, ExpertWidth, Family, MoeWiring};
use crate::config::{Gating, KeyHeadOf, QkNorm};
use crate::tensors::Role;

pub const FAMILY: Family = Family {
    arch: Arch::Qwen3Next,
    gguf_name: "qwen3next",
    qk_norm: QkNorm::PerHead,
    ffn_norm: Role::PostAttnNorm,
    moe: Some(MoeWiring {
        required: true,
        gating: Gating::Softmax,
        renormalize: true,
        expert_width: ExpertWidth::KeyOrShare,
        gated_shared_expert: true,
        biases: false,
    }),
    finish: |k, cfg| super::hybrid_layers(k, cfg, KeyHeadOf::Grouped),
    ..Family::BASE
};

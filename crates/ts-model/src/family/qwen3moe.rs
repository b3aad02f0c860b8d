//! Qwen3-MoE (`src/models/qwen3moe.cpp`): per-head q/k norms; softmax, top-k,
//! renormalised.

use super::{Arch, ExpertWidth, Family, MoeWiring};
use crate::config::{Gating, QkNorm};

pub const FAMILY: Family = Family {
    arch: Arch::Qwen3Moe,
    gguf_name: "qwen3moe",
    qk_norm: QkNorm::PerHead,
    moe: Some(MoeWiring {
        required: true,
        gating: Gating::Softmax,
        renormalize: true,
        expert_width: ExpertWidth::KeyOrShare,
        gated_shared_expert: false,
        biases: false,
        beside_dense: false,
    }),
    ..Family::BASE
};

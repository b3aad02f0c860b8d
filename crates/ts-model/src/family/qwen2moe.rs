//! Qwen2-MoE (`src/models/qwen2moe.cpp`): q/k/v biases; softmax routing without
//! renormalisation; a shared expert scaled by a sigmoid gate.

use super::{Arch, ExpertWidth, Family, MoeWiring};
use crate::config::Gating;

pub const FAMILY: Family = Family {
    arch: Arch::Qwen2Moe,
    gguf_name: "qwen2moe",
    qkv_bias: true,
    tied_output: false,
    moe: Some(MoeWiring {
        required: true,
        gating: Gating::Softmax,
        renormalize: false,
        expert_width: ExpertWidth::KeyOrShare,
        gated_shared_expert: true,
        biases: false,
        beside_dense: false,
    }),
    ..Family::BASE
};

//! Llama and Mistral (`src/models/llama.cpp`); Mixtral is `llama` with experts.
//! The converter permutes q/k rows so rope pairs adjacent dimensions; sliding
//! windows are never applied.

use super::{Arch, ExpertWidth, Family, MoeWiring};
use crate::config::{Gating, RopeLayout};

pub const FAMILY: Family = Family {
    arch: Arch::Llama,
    gguf_name: "llama",
    rope_layout: RopeLayout::Interleaved,
    moe: Some(MoeWiring {
        required: false,
        gating: Gating::Softmax,
        renormalize: true,
        expert_width: ExpertWidth::DenseWidth,
        gated_shared_expert: false,
        biases: false,
        beside_dense: false,
    }),
    ..Family::BASE
};

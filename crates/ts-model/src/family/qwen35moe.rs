//! Qwen3.5 MoE (`src/models/qwen35moe.cpp`): three Gated DeltaNet layers to one
//! gated attention layer (q/k norms, rope on the first quarter of each head:
//! its IMROPE sections reduce to NEOX for text), softmax routing renormalised,
//! a sigmoid-gated shared expert, the pre-FFN norm named `post_attention_norm`.
//! The converter reorders value heads so value head h reads key head h mod n_k.

use super::{Arch, Family, QWEN_HYBRID};
use crate::config::KeyHeadOf;

pub const FAMILY: Family = Family {
    arch: Arch::Qwen35Moe,
    gguf_name: "qwen35moe",
    finish: |k, cfg| super::hybrid_layers(k, cfg, KeyHeadOf::Tiled),
    ..QWEN_HYBRID
};

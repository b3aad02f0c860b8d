//! Qwen3-Next (`src/models/qwen3next.cpp`): the blocks of qwen35moe with value
//! heads in Hugging Face's order (value head h reads key head h / (n_v / n_k))
//! and beta and alpha in one projection, `ssm_ba`, grouped by key head.

use super::{Arch, Family, QWEN_HYBRID};
use crate::config::KeyHeadOf;

pub const FAMILY: Family = Family {
    arch: Arch::Qwen3Next,
    gguf_name: "qwen3next",
    finish: |k, cfg| super::hybrid_layers(k, cfg, KeyHeadOf::Grouped),
    ..QWEN_HYBRID
};

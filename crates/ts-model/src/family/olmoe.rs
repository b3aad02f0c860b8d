//! OLMoE (`src/models/olmoe.cpp`): q/k norms over the whole projection;
//! softmax routing without renormalisation; experts as wide as `feed_forward_length`.

use super::{Arch, ExpertWidth, Family, MoeWiring};
use crate::config::{Gating, QkNorm};

pub const FAMILY: Family = Family {
    arch: Arch::Olmoe,
    gguf_name: "olmoe",
    qk_norm: QkNorm::Full,
    tied_output: false,
    moe: Some(MoeWiring {
        required: true,
        gating: Gating::Softmax,
        renormalize: false,
        expert_width: ExpertWidth::DenseWidth,
        gated_shared_expert: false,
        biases: false,
        beside_dense: false,
    }),
    ..Family::BASE
};

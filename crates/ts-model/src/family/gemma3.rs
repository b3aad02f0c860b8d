//! Gemma 3 (`src/models/gemma3.cpp`): embeddings times sqrt(n_embd), per-head
//! q/k norms, norms after attention and after the FFN, GeGLU, 5 local layers
//! to 1 global with their own rope base, an optional final softcap.

use super::{Arch, Family, LocalRope, Sliding};
use crate::config::{GatedActivation, QkNorm};

pub const FAMILY: Family = Family {
    arch: Arch::Gemma3,
    gguf_name: "gemma3",
    qk_norm: QkNorm::PerHead,
    post_norms: true,
    ffn_act: GatedActivation::GeGlu,
    scale_embeddings: true,
    final_softcap: true,
    sliding: Some(Sliding {
        period: 6,
        window_required: false,
        local_rope: LocalRope::OwnBaseUnscaled { default_base: 10_000.0 },
    }),
    finish: |_, cfg| {
        // llama.cpp: 1/sqrt(n_embd/n_head) for the 62-layer 27B, else 1/sqrt(head_dim).
        if cfg.n_layer == 62 {
            cfg.attn_scale = 1.0 / ((cfg.n_embd / cfg.n_head) as f32).sqrt();
        }
        Ok(())
    },
    ..Family::BASE
};

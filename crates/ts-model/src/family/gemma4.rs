//! Gemma 4 (`src/models/gemma4.cpp`; docs/FAMILIES.md §7): sliding and global
//! layers with their own head sizes, kv heads and rope (the global layers'
//! partial "proportional" rope through `rope_freqs`), per-head q/k norms and a
//! weightless v norm, attention scale 1, norms before and after attention and
//! the FFN, GeGLU, a tail of layers that read an earlier layer's keys and
//! values, per-layer embeddings (E models), a per-layer output scale, a final
//! softcap of 30 unless the file says otherwise; the MoE variant runs a dense
//! MLP and routed experts side by side.

use super::{Arch, ExpertWidth, Family, MoeWiring};
use crate::ModelError;
use crate::config::{ArchConfig, AttnLayer, GatedActivation, Gating, Keys, Mixer, QkNorm, RopeConfig, RopeScaling};

pub const FAMILY: Family = Family {
    arch: Arch::Gemma4,
    gguf_name: "gemma4",
    qk_norm: QkNorm::PerHead,
    post_norms: true,
    v_norm: true,
    ffn_act: GatedActivation::GeGlu,
    scale_embeddings: true,
    final_softcap: true,
    moe: Some(MoeWiring {
        required: false,
        gating: Gating::Softmax,
        renormalize: true,
        expert_width: ExpertWidth::Key,
        gated_shared_expert: false,
        biases: false,
        beside_dense: true,
    }),
    finish,
    ..Family::BASE
};

fn finish(k: &Keys, cfg: &mut ArchConfig) -> Result<(), ModelError> {
    let n = cfg.n_layer;
    let bad = |key: &str, problem: String| ModelError::BadKey { key: k.name(key), problem };
    let swa = k
        .flags("attention.sliding_window_pattern", n)?
        .ok_or_else(|| ModelError::MissingKey(k.name("attention.sliding_window_pattern")))?;
    let window = k.req_usize("attention.sliding_window")?;
    let (hd_full, hdv_full) = (cfg.head_dim, cfg.head_dim_v);
    let hd_swa = k.req_usize("attention.key_length_swa")?;
    let hdv_swa = k.usize("attention.value_length_swa")?.unwrap_or(hd_swa);
    let n_rot_full = k.usize("rope.dimension_count")?.unwrap_or(hd_full);
    let n_rot_swa = k.usize("rope.dimension_count_swa")?.unwrap_or(n_rot_full);
    for (key, n_rot, hd) in
        [("rope.dimension_count", n_rot_full, hd_full), ("rope.dimension_count_swa", n_rot_swa, hd_swa)]
    {
        if n_rot > hd || n_rot % 2 != 0 {
            return Err(bad(key, format!("{n_rot} must be even and at most the head size {hd}")));
        }
    }
    let base_full = k.f32("rope.freq_base")?.unwrap_or(10_000.0);
    let base_swa = k.f32("rope.freq_base_swa")?.unwrap_or(10_000.0);
    let kv_heads = k.per_layer("attention.head_count_kv", n)?.unwrap_or(vec![cfg.n_head; n]);
    let n_ff = k.per_layer("feed_forward_length", n)?.unwrap_or(vec![0; n]);
    // The last `shared` layers read layer n_kv - 2 (sliding) or n_kv - 1 (global), as
    // llama.cpp's create_memory hard-codes it.
    let shared = k.usize("attention.shared_kv_layers")?.unwrap_or(0);
    let n_kv = n.checked_sub(shared).filter(|&n_kv| shared == 0 || (n_kv >= 2 && swa[n_kv - 2] && !swa[n_kv - 1]));
    let n_kv = n_kv.ok_or_else(|| {
        bad(
            "attention.shared_kv_layers",
            format!("{shared} of {n} layers: the two before must be sliding, then global"),
        )
    })?;
    for (il, l) in cfg.layers.iter_mut().enumerate() {
        let (hd, hdv, n_rot, base) =
            if swa[il] { (hd_swa, hdv_swa, n_rot_swa, base_swa) } else { (hd_full, hdv_full, n_rot_full, base_full) };
        if kv_heads[il] == 0 || !cfg.n_head.is_multiple_of(kv_heads[il]) {
            return Err(bad(
                "attention.head_count_kv",
                format!("{} does not divide {} heads", kv_heads[il], cfg.n_head),
            ));
        }
        let rope = RopeConfig {
            layout: FAMILY.rope_layout,
            n_rot,
            freq_base: base,
            scaling: RopeScaling::None,
            attn_factor: 1.0,
        };
        l.mixer = Mixer::Attention(AttnLayer {
            sliding_window: swa[il].then_some(window),
            rope,
            rope_freq_factors: !swa[il],
            n_head_kv: kv_heads[il],
            head_dim: hd,
            head_dim_v: hdv,
            kv_from: (il >= n_kv).then(|| if swa[il] { n_kv - 2 } else { n_kv - 1 }),
        });
        l.n_ff = n_ff[il];
    }
    // The q/k norms carry the scale.
    cfg.attn_scale = 1.0;
    cfg.per_layer_input = k.usize("embedding_length_per_layer_input")?.unwrap_or(0);
    // llama.cpp keeps its default of 30 when the key is absent (unlike gemma3's 0).
    cfg.final_softcap = Some(k.f32("final_logit_softcapping")?.unwrap_or(30.0)).filter(|&c| c > 0.0);
    Ok(())
}

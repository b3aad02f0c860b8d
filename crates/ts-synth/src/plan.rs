//! The layout of a synthetic file: metadata keys as llama.cpp's converter writes them,
//! and every tensor's name, ggml-order shape, type and how its values are drawn.

use crate::fill::{EmbeddingCodec, WeightCodec};
use crate::rng::{derive, name_hash};
use crate::routing;
use crate::spec::{Family, ModelSpec, Recipe};
use crate::{SynthError, SynthOptions};
use ts_gguf::{Array, GgmlType, GgufWriter, Value};

/// Standard deviation of biases and of the jitter on norm weights.
const SMALL_STD: f64 = 0.02;

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fill {
    /// Zero mean, standard deviation `1/sqrt(row length)`.
    Weights,
    /// `1 + N(0, 0.02²)`.
    Norm,
    /// `N(0, 0.02²)`.
    Bias,
    /// Uniform in `[0, 1)`: attention-sink logits.
    Sinks,
    /// Token embeddings: the common vector plus each row's random part.
    Embedding,
    /// The router of a layer (see `routing`).
    Router { layer: usize },
    /// `ssm_a = −A` (the converter stores `−exp(A_log)`), A uniform in `[1, 16]`.
    SsmA,
    /// `ssm_dt.bias = softplus⁻¹(dt)`, dt log-uniform in `[0.001, 0.1]`.
    DtBias,
    /// `g·(1 + N(0, 0.02²))`: a norm whose gain is not 1.
    Gain(f32),
    /// `rope_freqs` of a proportional rope: factor 1 on the first `rotated / 2`
    /// frequencies, 1e30 (frozen) on the rest, as the gemma4 converter writes it.
    ProportionalRope { rotated: usize },
}

#[derive(Clone, Debug)]
pub struct PlannedTensor {
    pub name: String,
    pub ty: GgmlType,
    /// ggml order: `dims[0]` is the row length.
    pub dims: Vec<u64>,
    pub fill: Fill,
}

impl PlannedTensor {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    pub fn n_bytes(&self) -> u64 {
        self.ty.bytes_for(self.n_elements()).expect("sizes checked when planned")
    }
}

/// A synthetic file, laid out but not written.
#[derive(Clone, Debug)]
pub struct Plan {
    pub spec: ModelSpec,
    pub opts: SynthOptions,
    pub n_layer: usize,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<PlannedTensor>,
    embedding: EmbeddingCodec,
    embedding_std: f64,
}

/// Expert types `--quant` takes.
pub const EXPERT_TYPES: [GgmlType; 6] =
    [GgmlType::Q4_0, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::Q8_0, GgmlType::MXFP4];

/// An expert type by its lower-case ggml name (`q4_k`, `mxfp4`, ...).
pub fn parse_quant(name: &str) -> Result<GgmlType, SynthError> {
    EXPERT_TYPES.into_iter().find(|t| t.name().eq_ignore_ascii_case(name)).ok_or_else(|| SynthError::UnknownType {
        name: name.into(),
        choices: EXPERT_TYPES.map(|t| t.name().to_ascii_lowercase()).join(", "),
    })
}

/// llama-quantize's choice of layers that get more bits (`use_more_bits` in llama-quant.cpp).
fn use_more_bits(layer: usize, n_layer: usize) -> bool {
    layer < n_layer / 8 || layer >= 7 * n_layer / 8 || (layer - n_layer / 8) % 3 == 2
}

/// `general.file_type` (llama_ftype) of a file whose experts are `ty`.
fn file_type(recipe: Recipe, expert: Option<GgmlType>) -> u32 {
    match (recipe, expert) {
        (Recipe::Mxfp4Moe, None) | (_, Some(GgmlType::MXFP4)) => 38,
        (Recipe::Q4KM, None) | (_, Some(GgmlType::Q4_K)) => 15,
        (_, Some(GgmlType::Q4_0)) => 2,
        (_, Some(GgmlType::Q8_0)) => 7,
        (_, Some(GgmlType::Q5_K)) => 17,
        (_, Some(GgmlType::Q6_K)) => 18,
        (_, Some(_)) => 0,
    }
}

/// Range of A in `ssm_a = −A` (Hugging Face initialises `A_log = ln U(0, 16)`; the lower
/// bound keeps every head decaying).
const SSM_A_RANGE: (f64, f64) = (1.0, 16.0);
/// Range of the time step whose inverse softplus is `dt_bias` (Mamba-2 / Gated DeltaNet's
/// initialisation: log-uniform between these).
const DT_RANGE: (f64, f64) = (0.001, 0.1);

/// Tensor types of one layer: attention q, k, v, output; expert gate/up, down; the shared
/// expert's down projection; the other matrices of a hybrid layer (linear-attention
/// projections, shared expert gate and up).
struct LayerTypes {
    q: GgmlType,
    k: GgmlType,
    /// `attn_v`, and `attn_qkv` in a linear-attention layer (llama-quantize counts both as
    /// "attn_v-like").
    v: GgmlType,
    o: GgmlType,
    gate_up: GgmlType,
    down: GgmlType,
    shexp_down: GgmlType,
    other: GgmlType,
}

impl Plan {
    pub fn new(spec: &ModelSpec, opts: &SynthOptions) -> Result<Plan, SynthError> {
        let n_layer = match opts.layers {
            None => spec.n_layer,
            Some(n) if (1..=spec.n_layer).contains(&n) => n,
            Some(n) => return Err(SynthError::Layers { asked: n, max: spec.n_layer }),
        };
        if let Some(ty) = opts.expert_type {
            for row in [spec.n_embd, spec.n_ff_exp] {
                if !(row as u64).is_multiple_of(ty.block_size()) {
                    return Err(SynthError::Incompatible {
                        ty: ty.name().to_ascii_lowercase(),
                        model: spec.name.into(),
                        row,
                        block: ty.block_size(),
                    });
                }
            }
        }
        let (token_type, output_type) = match spec.recipe {
            Recipe::Mxfp4Moe => (GgmlType::Q8_0, GgmlType::Q8_0),
            // A tied table takes the output's type (llama-quant.cpp: has_tied_embeddings).
            Recipe::Q4KM if spec.family.tied_output() => (GgmlType::Q6_K, GgmlType::Q6_K),
            Recipe::Q4KM => (GgmlType::Q4_K, GgmlType::Q6_K),
        };
        let (mut level, mut embedding_std) =
            routing::embedding_levels(spec.n_embd, opts.routing, derive(opts.seed, name_hash("common vector")));
        if spec.family.tied_output() {
            // The table is also the output projection: rows of RMS 1/sqrt(n_embd) give unit
            // logits, and the input, scaled by sqrt(n_embd) (Gemma), an RMS of 1.
            let f = 1.0 / (routing::EMBEDDING_RMS * (spec.n_embd as f64).sqrt());
            level.iter_mut().for_each(|l| *l *= f);
            embedding_std *= f;
        }
        let embedding = EmbeddingCodec::new(token_type, spec.n_embd, embedding_std, &level)?;

        let mut plan = Plan {
            spec: spec.clone(),
            opts: opts.clone(),
            n_layer,
            metadata: Vec::new(),
            tensors: Vec::new(),
            embedding,
            embedding_std,
        };
        plan.metadata = plan.metadata_keys();
        let (e, v) = (spec.n_embd as u64, spec.n_vocab as u64);
        plan.add("token_embd.weight", token_type, &[e, v], Fill::Embedding);
        if let Some(sl) = spec.sliding {
            plan.add(
                "rope_freqs.weight",
                GgmlType::F32,
                &[spec.head_dim as u64 / 2],
                Fill::ProportionalRope { rotated: sl.global_rotated },
            );
        }
        for il in 0..n_layer {
            plan.add_layer(il, plan.layer_types(il));
        }
        plan.add("output_norm.weight", GgmlType::F32, &[e], Fill::Norm);
        if !spec.family.tied_output() {
            plan.add("output.weight", output_type, &[e, v], Fill::Weights);
        }
        Ok(plan)
    }

    fn add(&mut self, name: &str, ty: GgmlType, dims: &[u64], fill: Fill) {
        self.tensors.push(PlannedTensor { name: name.into(), ty, dims: dims.to_vec(), fill });
    }

    fn layer_types(&self, il: usize) -> LayerTypes {
        let spec = &self.spec;
        let more_bits = use_more_bits(il, self.n_layer);
        let mut t = match spec.recipe {
            Recipe::Mxfp4Moe => LayerTypes {
                q: GgmlType::Q8_0,
                k: GgmlType::Q8_0,
                v: GgmlType::Q8_0,
                o: GgmlType::Q8_0,
                gate_up: GgmlType::MXFP4,
                down: GgmlType::MXFP4,
                shexp_down: GgmlType::Q8_0,
                other: GgmlType::Q8_0,
            },
            Recipe::Q4KM => {
                let eight = spec.n_expert == 8;
                let more = if more_bits { GgmlType::Q6_K } else { GgmlType::Q4_K };
                LayerTypes {
                    q: GgmlType::Q4_K,
                    k: if eight { GgmlType::Q8_0 } else { GgmlType::Q4_K },
                    v: if eight { GgmlType::Q8_0 } else { more },
                    o: if eight { GgmlType::Q5_K } else { GgmlType::Q4_K },
                    gate_up: GgmlType::Q4_K,
                    down: more,
                    // ffn_down_shexp is an "ffn_down" to llama-quantize.
                    shexp_down: more,
                    other: GgmlType::Q4_K,
                }
            }
        };
        if let (Recipe::Q4KM, Some(sl)) = (spec.recipe, spec.sliding) {
            // Gemma 4 (docs/FAMILIES.md §7.5): attn_v exists on sliding layers only and
            // llama-quantize counts over those; the down projections' rows (2112, 704) are
            // no multiple of 256, so Q6_K falls back to Q8_0 and Q4_K to Q5_0.
            let n_v = (0..self.n_layer).filter(|&l| sl.is_sliding(l)).count();
            let j = (0..il).filter(|&l| sl.is_sliding(l)).count();
            t.k = GgmlType::Q4_K;
            t.o = GgmlType::Q4_K;
            t.v = if use_more_bits(j, n_v) { GgmlType::Q6_K } else { GgmlType::Q4_K };
            t.down = if more_bits { GgmlType::Q8_0 } else { GgmlType::Q5_0 };
            t.shexp_down = t.down;
        }
        if let Some(ty) = self.opts.expert_type {
            t.gate_up = ty;
            t.down = ty;
        }
        t
    }

    fn add_layer(&mut self, il: usize, t: LayerTypes) {
        if self.spec.family.is_hybrid() {
            return self.add_hybrid_layer(il, t);
        }
        if self.spec.family == Family::Gemma4 {
            return self.add_gemma4_layer(il, t);
        }
        let s = self.spec.clone();
        let (e, hd) = (s.n_embd as u64, s.head_dim as u64);
        let (q, kv) = (s.n_head as u64 * hd, s.n_head_kv as u64 * hd);
        let name = |base: &str| format!("blk.{il}.{base}");
        let gpt_oss = s.family == Family::GptOss;

        self.add(&name("attn_norm.weight"), GgmlType::F32, &[e], Fill::Norm);
        for (base, ty, width) in [("attn_q", t.q, q), ("attn_k", t.k, kv), ("attn_v", t.v, kv)] {
            self.add(&name(&format!("{base}.weight")), ty, &[e, width], Fill::Weights);
            if gpt_oss {
                self.add(&name(&format!("{base}.bias")), GgmlType::F32, &[width], Fill::Bias);
            }
        }
        self.add(&name("attn_output.weight"), t.o, &[q, e], Fill::Weights);
        match s.family {
            Family::GptOss => {
                self.add(&name("attn_output.bias"), GgmlType::F32, &[e], Fill::Bias);
                self.add(&name("attn_sinks.weight"), GgmlType::F32, &[s.n_head as u64], Fill::Sinks);
                // gpt-oss's pre-FFN norm.
                self.add(&name("post_attention_norm.weight"), GgmlType::F32, &[e], Fill::Norm);
            }
            Family::Qwen3Moe => {
                self.add(&name("attn_q_norm.weight"), GgmlType::F32, &[hd], Fill::Norm);
                self.add(&name("attn_k_norm.weight"), GgmlType::F32, &[hd], Fill::Norm);
                self.add(&name("ffn_norm.weight"), GgmlType::F32, &[e], Fill::Norm);
            }
            Family::Mixtral => self.add(&name("ffn_norm.weight"), GgmlType::F32, &[e], Fill::Norm),
            Family::Qwen35Moe | Family::Qwen3Next | Family::Gemma4 => unreachable!("laid out apart"),
        }
        self.add_experts(il, &t);
    }

    /// The router and the routed experts (gpt-oss: with biases).
    fn add_experts(&mut self, il: usize, t: &LayerTypes) {
        let s = &self.spec;
        let (e, n_exp, ff) = (s.n_embd as u64, s.n_expert as u64, s.n_ff_exp as u64);
        let gpt_oss = s.family == Family::GptOss;
        let name = |base: &str| format!("blk.{il}.{base}");
        self.add(&name("ffn_gate_inp.weight"), GgmlType::F32, &[e, n_exp], Fill::Router { layer: il });
        if gpt_oss {
            self.add(&name("ffn_gate_inp.bias"), GgmlType::F32, &[n_exp], Fill::Bias);
        }
        for (base, ty, dims) in [
            ("ffn_gate_exps", t.gate_up, [e, ff, n_exp]),
            ("ffn_up_exps", t.gate_up, [e, ff, n_exp]),
            ("ffn_down_exps", t.down, [ff, e, n_exp]),
        ] {
            self.add(&name(&format!("{base}.weight")), ty, &dims, Fill::Weights);
            if gpt_oss {
                self.add(&name(&format!("{base}.bias")), GgmlType::F32, &[dims[1], n_exp], Fill::Bias);
            }
        }
    }

    /// A qwen35moe / qwen3next layer (docs/FAMILIES.md §6.2): Gated DeltaNet or gated
    /// attention, the pre-MoE norm `post_attention_norm`, routed experts and a shared expert
    /// behind a sigmoid gate.
    fn add_hybrid_layer(&mut self, il: usize, t: LayerTypes) {
        let s = self.spec.clone();
        let lin = s.linear.expect("a hybrid family has linear-attention shapes");
        let (e, hd) = (s.n_embd as u64, s.head_dim as u64);
        let (q, kv) = (s.n_head as u64 * hd, s.n_head_kv as u64 * hd);
        let (conv, v_dim, nv) = (lin.conv_dim() as u64, lin.v_dim() as u64, lin.n_v_heads as u64);
        let sh = s.n_ff_shexp as u64;
        let name = |base: &str| format!("blk.{il}.{base}");

        self.add(&name("attn_norm.weight"), GgmlType::F32, &[e], Fill::Norm);
        if lin.is_recurrent(il) {
            self.add(&name("attn_qkv.weight"), t.v, &[e, conv], Fill::Weights);
            self.add(&name("attn_gate.weight"), t.other, &[e, v_dim], Fill::Weights);
            // Each channel's taps are a row: spread 1/sqrt(taps) keeps the input's spread.
            self.add(&name("ssm_conv1d.weight"), GgmlType::F32, &[lin.conv_kernel as u64, conv], Fill::Weights);
            self.add(&name("ssm_dt.bias"), GgmlType::F32, &[nv], Fill::DtBias);
            self.add(&name("ssm_a"), GgmlType::F32, &[nv], Fill::SsmA);
            match s.family {
                Family::Qwen3Next => self.add(&name("ssm_ba.weight"), t.other, &[e, 2 * nv], Fill::Weights),
                _ => {
                    self.add(&name("ssm_beta.weight"), t.other, &[e, nv], Fill::Weights);
                    self.add(&name("ssm_alpha.weight"), t.other, &[e, nv], Fill::Weights);
                }
            }
            self.add(&name("ssm_norm.weight"), GgmlType::F32, &[lin.head_dim as u64], Fill::Norm);
            self.add(&name("ssm_out.weight"), t.other, &[v_dim, e], Fill::Weights);
        } else {
            // Per head [q | gate]: the gate multiplies the attention output by sigmoid(gate).
            self.add(&name("attn_q.weight"), t.q, &[e, 2 * q], Fill::Weights);
            self.add(&name("attn_k.weight"), t.k, &[e, kv], Fill::Weights);
            self.add(&name("attn_v.weight"), t.v, &[e, kv], Fill::Weights);
            self.add(&name("attn_output.weight"), t.o, &[q, e], Fill::Weights);
            self.add(&name("attn_q_norm.weight"), GgmlType::F32, &[hd], Fill::Norm);
            self.add(&name("attn_k_norm.weight"), GgmlType::F32, &[hd], Fill::Norm);
        }
        self.add(&name("post_attention_norm.weight"), GgmlType::F32, &[e], Fill::Norm);
        self.add_experts(il, &t);
        // The converter writes the gate [1, n_embd] of Hugging Face as [n_embd, 1]; its
        // spread 1/sqrt(n_embd) gives gate logits of spread about 1.
        self.add(&name("ffn_gate_inp_shexp.weight"), GgmlType::F32, &[e, 1], Fill::Weights);
        self.add(&name("ffn_gate_shexp.weight"), t.other, &[e, sh], Fill::Weights);
        self.add(&name("ffn_up_shexp.weight"), t.other, &[e, sh], Fill::Weights);
        self.add(&name("ffn_down_shexp.weight"), t.shexp_down, &[sh, e], Fill::Weights);
    }

    /// A gemma4 MoE layer (docs/FAMILIES.md §7): sliding or global attention with
    /// q/k norms (a global layer has no `attn_v`: V is K), norms after attention and
    /// after each FFN, the dense MLP and the experts (gate and up fused) side by side,
    /// the router's input scale, the experts' output scales, the layer's output scale.
    fn add_gemma4_layer(&mut self, il: usize, t: LayerTypes) {
        let s = self.spec.clone();
        let sl = s.sliding.expect("gemma4 has sliding layers");
        let sliding = sl.is_sliding(il);
        let (hd, n_kv) = if sliding { (sl.head_dim, sl.n_head_kv) } else { (s.head_dim, s.n_head_kv) };
        let (e, hd, ff) = (s.n_embd as u64, hd as u64, s.n_ff as u64);
        let (q, kv) = (s.n_head as u64 * hd, n_kv as u64 * hd);
        let (n_exp, ff_exp) = (s.n_expert as u64, s.n_ff_exp as u64);
        let name = |base: &str| format!("blk.{il}.{base}");
        let norm = |plan: &mut Plan, base: &str, width: u64| plan.add(&name(base), GgmlType::F32, &[width], Fill::Norm);

        norm(self, "attn_norm.weight", e);
        self.add(&name("attn_q.weight"), t.q, &[e, q], Fill::Weights);
        self.add(&name("attn_k.weight"), t.k, &[e, kv], Fill::Weights);
        if sliding {
            self.add(&name("attn_v.weight"), t.v, &[e, kv], Fill::Weights);
        }
        self.add(&name("attn_output.weight"), t.o, &[q, e], Fill::Weights);
        norm(self, "attn_q_norm.weight", hd);
        norm(self, "attn_k_norm.weight", hd);
        norm(self, "post_attention_norm.weight", e);
        norm(self, "ffn_norm.weight", e);
        self.add(&name("ffn_gate.weight"), t.other, &[e, ff], Fill::Weights);
        self.add(&name("ffn_up.weight"), t.other, &[e, ff], Fill::Weights);
        self.add(&name("ffn_down.weight"), t.shexp_down, &[ff, e], Fill::Weights);
        norm(self, "post_ffw_norm_1.weight", e);
        norm(self, "pre_ffw_norm_2.weight", e);
        self.add(&name("ffn_gate_inp.weight"), GgmlType::F32, &[e, n_exp], Fill::Router { layer: il });
        // The router reads rmsnorm(x)·scale/sqrt(n_embd): a scale of sqrt(n_embd) gives it
        // the unit-RMS input the other families' routers see.
        self.add(&name("ffn_gate_inp.scale"), GgmlType::F32, &[e], Fill::Gain((s.n_embd as f32).sqrt()));
        self.add(&name("ffn_gate_up_exps.weight"), t.gate_up, &[e, 2 * ff_exp, n_exp], Fill::Weights);
        self.add(&name("ffn_down_exps.weight"), t.down, &[ff_exp, e, n_exp], Fill::Weights);
        norm(self, "ffn_down_exps.scale", n_exp);
        norm(self, "post_ffw_norm_2.weight", e);
        norm(self, "post_ffw_norm.weight", e);
        norm(self, "layer_output_scale.weight", 1);
    }

    fn metadata_keys(&self) -> Vec<(String, Value)> {
        let s = &self.spec;
        let arch = s.family.gguf_arch();
        let mut md: Vec<(String, Value)> = Vec::new();
        let mut put = |key: &str, v: Value| md.push((key.replace("{arch}", arch), v));
        let u32v = |x: usize| Value::U32(x as u32);
        put("general.architecture", Value::String(arch.into()));
        put("general.type", Value::String("model".into()));
        put("general.name", Value::String(format!("{} (synthetic, random weights)", s.name)));
        put("{arch}.block_count", u32v(self.n_layer));
        put("{arch}.context_length", u32v(s.n_ctx_train));
        put("{arch}.embedding_length", u32v(s.n_embd));
        if s.n_ff > 0 {
            put("{arch}.feed_forward_length", u32v(s.n_ff));
        }
        put("{arch}.attention.head_count", u32v(s.n_head));
        match s.sliding {
            // Per layer: the sliding and global layers differ.
            Some(sl) => {
                let kv = (0..self.n_layer)
                    .map(|il| if sl.is_sliding(il) { sl.n_head_kv } else { s.n_head_kv } as u32)
                    .collect();
                put("{arch}.attention.head_count_kv", Value::Array(Array::U32(kv)));
            }
            None => put("{arch}.attention.head_count_kv", u32v(s.n_head_kv)),
        }
        if let Some(sections) = s.rope_sections {
            put("{arch}.rope.dimension_sections", Value::Array(Array::I32(sections.to_vec())));
        }
        put("{arch}.rope.freq_base", Value::F32(s.rope_freq_base));
        put("{arch}.attention.layer_norm_rms_epsilon", Value::F32(s.rms_eps));
        put("{arch}.expert_count", u32v(s.n_expert));
        put("{arch}.expert_used_count", u32v(s.n_expert_used));
        if s.family != Family::Mixtral {
            put("{arch}.attention.key_length", u32v(s.head_dim));
            put("{arch}.attention.value_length", u32v(s.head_dim));
        }
        if let Some((factor, original)) = s.yarn {
            put("{arch}.rope.scaling.type", Value::String("yarn".into()));
            put("{arch}.rope.scaling.factor", Value::F32(factor));
            put("{arch}.rope.scaling.original_context_length", u32v(original));
            put("{arch}.rope.scaling.yarn_beta_fast", Value::F32(32.0));
            put("{arch}.rope.scaling.yarn_beta_slow", Value::F32(1.0));
        }
        if let Some(w) = s.sliding_window {
            put("{arch}.attention.sliding_window", u32v(w));
        }
        if s.family != Family::Mixtral {
            put("{arch}.expert_feed_forward_length", u32v(s.n_ff_exp));
        }
        if s.n_ff_shexp > 0 {
            put("{arch}.expert_shared_feed_forward_length", u32v(s.n_ff_shexp));
        }
        if let Some(lin) = s.linear {
            // Qwen3NextModel.set_gguf_parameters: the ssm shapes, one flag per layer (the
            // converter's config always has layer_types; no MTP layers here) and the interval.
            put("{arch}.ssm.conv_kernel", u32v(lin.conv_kernel));
            put("{arch}.ssm.state_size", u32v(lin.head_dim));
            put("{arch}.ssm.group_count", u32v(lin.n_k_heads));
            put("{arch}.ssm.time_step_rank", u32v(lin.n_v_heads));
            put("{arch}.ssm.inner_size", u32v(lin.v_dim()));
            let flags = (0..self.n_layer).map(|il| lin.is_recurrent(il)).collect();
            put("{arch}.attention.recurrent_layers", Value::Array(Array::Bool(flags)));
            put("{arch}.full_attention_interval", u32v(lin.full_attention_interval));
        }
        if let Some(sl) = s.sliding {
            // Gemma4Model.set_gguf_parameters (conversion/gemma.py).
            put("{arch}.rope.freq_base_swa", Value::F32(sl.rope_freq_base));
            put("{arch}.attention.key_length_swa", u32v(sl.head_dim));
            put("{arch}.attention.value_length_swa", u32v(sl.head_dim));
            put("{arch}.rope.dimension_count_swa", u32v(sl.head_dim));
            let pattern = (0..self.n_layer).map(|il| sl.is_sliding(il)).collect();
            put("{arch}.attention.sliding_window_pattern", Value::Array(Array::Bool(pattern)));
            put("{arch}.attention.shared_kv_layers", u32v(0));
            put("{arch}.embedding_length_per_layer_input", u32v(0));
            put("{arch}.final_logit_softcapping", Value::F32(30.0));
        }
        // The llama converter writes these two; llama.cpp sizes a tokenizer-less vocabulary
        // from vocab_size, so every family gets it here.
        put("{arch}.vocab_size", u32v(s.n_vocab));
        if let Some(n_rot) = s.rope_dims {
            put("{arch}.rope.dimension_count", u32v(n_rot));
        }
        put("general.file_type", Value::U32(file_type(s.recipe, self.opts.expert_type)));
        put("general.quantization_version", Value::U32(2));
        put("tokenizer.ggml.model", Value::String("none".into()));
        // What the public file's tokenizer is; readers ignore it without tokens.
        if let Some(pre) = s.tokenizer_pre {
            put("tokenizer.ggml.pre", Value::String(pre.into()));
        }
        put("turbospark.synth.like", Value::String(s.name.into()));
        put("turbospark.synth.routing", Value::String(self.opts.routing.name().into()));
        put("turbospark.synth.seed", Value::U64(self.opts.seed));
        md
    }

    /// The GGUF header: metadata and tensor table.
    pub fn gguf_writer(&self) -> Result<GgufWriter, SynthError> {
        let mut w = GgufWriter::new();
        for (k, v) in &self.metadata {
            w.set(k, v.clone()).map_err(SynthError::internal)?;
        }
        for t in &self.tensors {
            w.add_tensor(&t.name, t.ty, &t.dims).map_err(SynthError::internal)?;
        }
        Ok(w)
    }

    /// Bytes of tensor data, padding included.
    pub fn data_bytes(&self) -> Result<u64, SynthError> {
        let w = self.gguf_writer()?;
        Ok(w.tensors().last().map_or(0, |t| (t.offset + t.n_bytes).next_multiple_of(ts_gguf::DEFAULT_ALIGNMENT)))
    }

    /// Size of the whole file, computed without writing it.
    pub fn file_size(&self) -> Result<u64, SynthError> {
        let mut head = Vec::new();
        self.gguf_writer()?.write_header(&mut head).map_err(SynthError::internal)?;
        Ok(head.len() as u64 + self.data_bytes()?)
    }

    /// Writes tensor `t`'s values into `out` (exactly its size).
    pub fn fill(&self, t: &PlannedTensor, out: &mut [u8]) -> Result<(), SynthError> {
        let seed = derive(self.opts.seed, name_hash(&t.name));
        let small = |std: f64, offset: f32, out: &mut [u8]| -> Result<(), SynthError> {
            WeightCodec::new(GgmlType::F32, std)?.fill(GgmlType::F32, seed, out);
            for v in out.chunks_exact_mut(4) {
                let x = f32::from_le_bytes(v.try_into().unwrap()) + offset;
                v.copy_from_slice(&x.to_le_bytes());
            }
            Ok(())
        };
        match t.fill {
            Fill::Weights => WeightCodec::new(t.ty, 1.0 / (t.dims[0] as f64).sqrt())?.fill(t.ty, seed, out),
            Fill::Norm => small(SMALL_STD, 1.0, out)?,
            Fill::Gain(g) => {
                small(SMALL_STD, 1.0, out)?;
                for v in out.chunks_exact_mut(4) {
                    let x = f32::from_le_bytes(v.try_into().unwrap()) * g;
                    v.copy_from_slice(&x.to_le_bytes());
                }
            }
            Fill::ProportionalRope { rotated } => {
                for (i, v) in out.chunks_exact_mut(4).enumerate() {
                    v.copy_from_slice(&(if 2 * i < rotated { 1.0f32 } else { 1e30 }).to_le_bytes());
                }
            }
            Fill::Bias => small(SMALL_STD, 0.0, out)?,
            Fill::Sinks => {
                let mut rng = crate::rng::Rng::new(seed);
                for v in out.chunks_exact_mut(4) {
                    v.copy_from_slice(&(rng.uniform() as f32).to_le_bytes());
                }
            }
            Fill::Embedding => self.embedding.fill(t.ty, seed, out),
            Fill::Router { .. } => {
                let rows = routing::router_rows(
                    self.opts.routing,
                    &self.embedding.mean,
                    self.embedding_std,
                    self.spec.n_expert,
                    self.spec.routing_skew as f64,
                    seed,
                );
                out.copy_from_slice(bytemuck::cast_slice(&rows));
            }
            Fill::SsmA | Fill::DtBias => {
                let mut rng = crate::rng::Rng::new(seed);
                for v in out.chunks_exact_mut(4) {
                    let u = rng.uniform();
                    let x = if t.fill == Fill::SsmA {
                        -(SSM_A_RANGE.0 + u * (SSM_A_RANGE.1 - SSM_A_RANGE.0))
                    } else {
                        let dt = (DT_RANGE.0.ln() + u * (DT_RANGE.1.ln() - DT_RANGE.0.ln())).exp();
                        // softplus⁻¹(dt) = ln(eˣ − 1)
                        dt.exp_m1().ln()
                    };
                    v.copy_from_slice(&(x as f32).to_le_bytes());
                }
            }
        }
        Ok(())
    }
}

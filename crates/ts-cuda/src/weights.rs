//! The model's weights on the device: uploaded once at open in their GGUF layouts, each
//! found again by the host address of the bytes or vector it came from (a range inside an
//! uploaded one, such as one expert of a stacked tensor, by its offset there).

use crate::{Cuda, err, type_suffix};
use ts_model::tensors::{Ffn, LayerWeights, MixerWeights};
use ts_model::weights::Weight;
use ts_model::{Model, ModelError};

impl Cuda {
    /// Puts every weight and vector of `model` the backend reads on the device.
    pub(crate) fn upload_model(&mut self, model: &Model) -> Result<(), ModelError> {
        let w = &model.weights;
        self.n_expert = model.cfg.moe.as_ref().map_or(0, |m| m.n_expert);
        self.upload_weight(&w.token_embd)?;
        self.upload_weight(&w.output)?;
        self.upload_vec(&w.output_norm)?;
        self.upload_opt(&w.output_bias)?;
        if let Some(p) = &w.per_layer_input {
            self.upload_weight(&p.token_embd)?;
            self.upload_weight(&p.model_proj)?;
            self.upload_vec(&p.proj_norm)?;
        }
        // Block n_layer, where there is one, is the MTP head's layer. The expert tier's counters
        // and slots know the trunk's layers only: with it, the head stays on the host and
        // `new_mtp_state` refuses `--spec-mtp`.
        let mtp = w.mtp.as_ref().filter(|_| self.tier.is_none());
        for (il, l) in w.layers.iter().chain(mtp.map(|m| &m.layer)).enumerate() {
            self.upload_layer(l)?;
            let table = match &model.ropes[il] {
                Some(rope) => Some(self.gpu.upload(&rope.inv_freq).map_err(err)?),
                None => None,
            };
            self.ropes.push(table);
            let window = model.cfg.layers.get(il).and_then(|l| l.sliding_window());
            self.windows.push(window.unwrap_or(0) as i32);
        }
        if let Some(m) = mtp {
            for t in [Some(&m.eh_proj_embd), Some(&m.eh_proj_hidden), m.embed_tokens.as_ref(), m.head.as_ref()]
                .into_iter()
                .flatten()
            {
                self.upload_weight(t)?;
            }
            for v in [&m.enorm, &m.hnorm, &m.shared_head_norm] {
                self.upload_vec(v)?;
            }
        }
        for a in model.cfg.layers.iter().filter_map(|l| l.attention()) {
            let (hd, hdv) = (a.head_dim, a.head_dim_v);
            if hd > 512 || hdv > 512 {
                return Err(ModelError::Compute(format!(
                    "cuda: head size {hd}/{hdv} is over the attention kernel's 512"
                )));
            }
        }
        if let Some(moe) = &model.cfg.moe
            && (moe.n_expert > 1024 || moe.n_expert_used > 64)
        {
            return Err(ModelError::Compute(format!(
                "cuda: {} experts, {} per token is over the router kernel's 1024 / 64",
                moe.n_expert, moe.n_expert_used
            )));
        }
        self.gpu.sync().map_err(err)?;
        Ok(())
    }

    /// Puts one block's weights on the device (routed experts only without an expert tier).
    pub(crate) fn upload_layer(&mut self, l: &LayerWeights) -> Result<(), ModelError> {
        if let Some(p) = &l.per_layer {
            self.upload_weight(&p.inp_gate)?;
            self.upload_weight(&p.proj)?;
            self.upload_vec(&p.post_norm)?;
        }
        for t in l.mixer.matrices() {
            self.upload_weight(t)?;
        }
        match &l.mixer {
            MixerWeights::Attention(a) => {
                for v in [&a.bq, &a.bk, &a.bv, &a.bo, &a.q_norm, &a.k_norm, &a.sinks] {
                    self.upload_opt(v)?;
                }
            }
            MixerWeights::DeltaNet(d) => {
                for v in [&d.conv, &d.dt_bias, &d.a, &d.norm] {
                    self.upload_vec(v)?;
                }
            }
        }
        self.upload_vec(&l.attn_norm)?;
        self.upload_vec(&l.ffn_norm)?;
        for v in [&l.attn_post_norm, &l.ffn_post_norm] {
            self.upload_opt(v)?;
        }
        match &l.ffn {
            Ffn::Dense { gate, up, down } => {
                for t in [gate, up, down] {
                    self.upload_weight(t)?;
                }
            }
            Ffn::Moe(m) => {
                self.upload_weight(&m.router)?;
                // A fused gate_up tensor goes up once; its halves point into it.
                if self.tier.is_none()
                    && let Some(both) = m.gate_exps.span_through(&m.up_exps)
                {
                    self.upload_bytes(&m.gate_exps.name, both)?;
                }
                for t in [&m.gate_exps, &m.up_exps, &m.down_exps] {
                    if type_suffix(t.ty).is_none() {
                        self.upload_weight(t)?; // the error names the tensor
                    }
                    if self.tier.is_none() {
                        self.upload_weight(t)?;
                    }
                }
                for v in [
                    &m.router_bias,
                    &m.gate_bias,
                    &m.up_bias,
                    &m.down_bias,
                    &m.expert_scale,
                    &m.input_norm,
                    &m.router_norm,
                    &m.output_norm,
                ] {
                    self.upload_opt(v)?;
                }
                if let Some(s) = &m.shared {
                    for t in [&s.gate, &s.up, &s.down] {
                        self.upload_weight(t)?;
                    }
                    self.upload_opt(&s.gate_inp)?;
                    self.upload_opt(&s.post_norm)?;
                }
            }
        }
        Ok(())
    }

    /// Puts `w` on the device (once; found again by the address of its host bytes).
    pub fn upload_weight(&mut self, w: &Weight) -> Result<(), ModelError> {
        if type_suffix(w.ty).is_none() {
            return Err(ModelError::BadTensor {
                name: w.name.clone(),
                problem: format!("type {} is not supported by the CUDA backend", w.ty),
            });
        }
        self.upload_bytes(&w.name, w.bytes())
    }

    /// Puts host bytes of the model on the device unless a range already there
    /// holds them.
    pub(crate) fn upload_bytes(&mut self, name: &str, bytes: &[u8]) -> Result<(), ModelError> {
        let key = bytes.as_ptr() as usize;
        if self.device_address(key, bytes.len()).is_none() {
            let buf = self
                .gpu
                .upload(bytes)
                .map_err(|e| ModelError::Compute(format!("cuda: uploading {name} ({} bytes): {e}", bytes.len())))?;
            self.weight_bytes += bytes.len();
            self.weights.insert(key, buf);
        }
        Ok(())
    }

    /// The device address of host bytes `addr..addr + len` of the model, where
    /// an uploaded range holds them.
    pub(crate) fn device_address(&self, addr: usize, len: usize) -> Option<u64> {
        let (&start, buf) = self.weights.range(..=addr).next_back()?;
        (addr + len <= start + buf.len()).then(|| self.gpu.ptr(buf) + (addr - start) as u64)
    }

    /// Puts an f32 vector of the model on the device (found again by its host address).
    pub fn upload_vec(&mut self, v: &[f32]) -> Result<(), ModelError> {
        let key = v.as_ptr() as usize;
        if !self.vectors.contains_key(&key) {
            let buf = self.gpu.upload(v).map_err(err)?;
            self.vectors.insert(key, buf);
        }
        Ok(())
    }

    pub(crate) fn upload_opt(&mut self, v: &Option<Vec<f32>>) -> Result<(), ModelError> {
        match v {
            Some(v) => self.upload_vec(v),
            None => Ok(()),
        }
    }

    /// Device address of weight `w`'s bytes.
    pub(crate) fn wptr(&self, w: &Weight) -> Result<u64, ModelError> {
        self.device_address(w.bytes().as_ptr() as usize, w.bytes().len())
            .ok_or_else(|| ModelError::Compute(format!("cuda: weight {} is not on the device", w.name)))
    }

    /// Device address of an f32 vector of the model.
    pub(crate) fn vptr(&self, v: &[f32]) -> Result<u64, ModelError> {
        let buf = self
            .vectors
            .get(&(v.as_ptr() as usize))
            .ok_or_else(|| ModelError::Compute("cuda: a vector of the model is not on the device".into()))?;
        Ok(self.gpu.ptr(buf))
    }
}

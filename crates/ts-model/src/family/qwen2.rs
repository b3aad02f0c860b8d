//! Qwen2 (`src/models/qwen2.cpp`): biases on q, k and v.

use super::{Arch, Family};

pub const FAMILY: Family = Family { arch: Arch::Qwen2, gguf_name: "qwen2", qkv_bias: true, ..Family::BASE };

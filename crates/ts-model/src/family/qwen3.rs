//! Qwen3 (`src/models/qwen3.cpp`): per-head RMS norms of q and k before rope.

use super::{Arch, Family};
use crate::config::QkNorm;

pub const FAMILY: Family = Family { arch: Arch::Qwen3, gguf_name: "qwen3", qk_norm: QkNorm::PerHead, ..Family::BASE };

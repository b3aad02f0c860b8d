pub mod chat;
pub mod constraint;
pub mod decode;
pub mod memory;
pub mod reuse;
pub mod sampler;
pub mod session;
pub mod speculative;

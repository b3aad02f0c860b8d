pub mod chat;
pub mod memory;
pub mod sampler;
pub mod session;

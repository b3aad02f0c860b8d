pub mod chat;
pub mod sampler;

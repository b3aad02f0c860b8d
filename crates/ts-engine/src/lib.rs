pub mod chat;
pub mod sampler;
pub mod session;

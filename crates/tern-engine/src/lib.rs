//! The engine: a backend trait with CPU (and later CUDA) implementations, sequences, the scheduler with its
//! prefix cache, and the `Engine` handle that streams generation events.

pub mod backend;
pub mod engine;
pub mod model;

pub use backend::{Backend, CpuBackend, ScriptedBackend, Sequence};
pub use engine::{Engine, EngineConfig, Event, FinishReason, Request, Stats, SubmitError, TokenLogprob, Usage};
pub use model::Model;

//! The engine: the backend seam (sequences owned by the backend, one step over many of them) with its CPU and
//! scripted implementations, the continuous-batching scheduler with its prefix cache, and the `Engine` handle that
//! streams generation events.

pub mod backend;
pub mod cost;
pub mod engine;
pub mod model;

pub use backend::{
    apply_mask, mask_allows, read_logits, sample_host, AllocError, Backend, CpuBackend, Image, MaskResult, MaskSlot,
    Output, Sample, Sampled, ScriptedBackend, SeqId, StateMemory, StepHook, TokenLogprob, Verify, Want, Work,
};
pub use engine::{
    Constraint, Engine, EngineConfig, Event, Events, FinishReason, Request, Stats, SubmitError, TokenConstraint, Usage,
};
pub use model::Model;
/// The sampling parameters [`Sample`] carries (tern-text's), for backends that sample on their own.
pub use tern_text::SamplingParams;

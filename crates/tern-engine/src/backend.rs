//! What the engine needs from a backend: sequences that read token ids and return the next token's logits.

use std::sync::Arc;

use anyhow::Result;
use tern_model::{Logits, State, Weights};

/// One sequence's state on a backend (KV cache, conv and recurrent state).
pub trait Sequence: Send {
    /// Read `ids` after what the sequence holds; return the logits `[vocab]` after the last one.
    fn forward(&mut self, ids: &[u32]) -> Result<Vec<f32>>;
    /// Greedy decoding without moving the logits: read `ids` and return the index of the largest of the first
    /// `limit` logits after the last one (ties: the lower index), where the backend finds it next to the logits
    /// (the CUDA step computes it on the device, so only the id crosses to the host). `None`, having read nothing:
    /// the backend has no such path; use [`Sequence::forward`].
    fn forward_argmax(&mut self, _ids: &[u32], _limit: usize) -> Result<Option<u32>> {
        Ok(None)
    }
    /// Tokens read so far.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// An independent copy of the state (for the prefix cache).
    fn fork(&self) -> Box<dyn Sequence>;
}

pub trait Backend: Send + Sync {
    /// "cpu", "cuda", ...
    fn name(&self) -> &str;
    fn vocab_size(&self) -> usize;
    fn new_sequence(&self) -> Box<dyn Sequence>;
}

/// The CPU backend: the reference forward pass on all cores.
pub struct CpuBackend {
    weights: Arc<Weights>,
}

impl CpuBackend {
    pub fn new(weights: Weights) -> CpuBackend {
        CpuBackend { weights: Arc::new(weights) }
    }
}

struct CpuSequence {
    weights: Arc<Weights>,
    state: State,
}

impl Sequence for CpuSequence {
    fn forward(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        let vocab = self.weights.config.vocab_size;
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            anyhow::bail!("token id {bad} is outside the vocabulary (size {vocab})");
        }
        Ok(self.weights.forward(ids, &mut self.state, Logits::Last))
    }
    fn len(&self) -> usize {
        self.state.pos
    }
    fn fork(&self) -> Box<dyn Sequence> {
        Box::new(CpuSequence { weights: self.weights.clone(), state: self.state.clone() })
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &str {
        "cpu"
    }
    fn vocab_size(&self) -> usize {
        self.weights.config.vocab_size
    }
    fn new_sequence(&self) -> Box<dyn Sequence> {
        Box::new(CpuSequence { weights: self.weights.clone(), state: State::new(&self.weights.config) })
    }
}

/// A backend that emits a fixed token script whatever the prompt: for testing the text and HTTP paths
/// (reasoning, tool calls) with exact model output. Token `i` of the reply is `script[i]`, then the last id
/// repeats; a read of several ids (a prompt chunk) starts the reply over, so a prompt read in chunks or partly
/// from the prefix cache gets the same reply.
pub struct ScriptedBackend {
    pub vocab: usize,
    pub script: Vec<u32>,
}

struct ScriptedSequence {
    vocab: usize,
    script: Arc<Vec<u32>>,
    read: usize,
    calls: usize,
}

impl Sequence for ScriptedSequence {
    fn forward(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        self.read += ids.len();
        if ids.len() > 1 {
            self.calls = 0;
        }
        let next = self.script[self.calls.min(self.script.len() - 1)];
        self.calls += 1;
        let mut logits = vec![0.0; self.vocab];
        logits[next as usize] = 30.0;
        Ok(logits)
    }
    fn len(&self) -> usize {
        self.read
    }
    fn fork(&self) -> Box<dyn Sequence> {
        Box::new(ScriptedSequence { vocab: self.vocab, script: self.script.clone(), read: self.read, calls: 0 })
    }
}

impl Backend for ScriptedBackend {
    fn name(&self) -> &str {
        "scripted"
    }
    fn vocab_size(&self) -> usize {
        self.vocab
    }
    fn new_sequence(&self) -> Box<dyn Sequence> {
        assert!(!self.script.is_empty(), "ScriptedBackend needs a non-empty script");
        Box::new(ScriptedSequence { vocab: self.vocab, script: Arc::new(self.script.clone()), read: 0, calls: 0 })
    }
}

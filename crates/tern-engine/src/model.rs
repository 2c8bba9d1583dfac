//! A model directory made ready to serve: the backend with its weights, the tokenizer, the chat template and
//! the generation defaults.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use tern_text::{ChatTemplate, SamplingParams, Tokenizer, DEFAULT_STOP_IDS};

use crate::backend::{Backend, CpuBackend};

pub struct Model {
    pub dir: PathBuf,
    /// The id clients use (`model` field of the OpenAI API): the directory name.
    pub name: String,
    pub backend: Arc<dyn Backend>,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Arc<ChatTemplate>,
    pub sampling: SamplingParams,
    pub stop_ids: Vec<u32>,
    /// How the backend reads images, when it does: `None` for a checkpoint without vision weights (or a backend
    /// without the vision tower), whose server answers image parts with a 400. Set by the loader.
    pub images: Option<ImageInput>,
}

/// What a server needs to turn an image into a prompt's image tokens for this model.
#[derive(Clone, Debug)]
pub struct ImageInput {
    /// The image processor's patching, normalisation and pixel budget (`preprocessor_config.json`, with the
    /// patch, merge and temporal sizes of the tower's `vision_config`).
    pub params: tern_model::vision::ImageParams,
    /// The pad token an image's tokens are written as in the prompt (`image_token_id`).
    pub image_token_id: u32,
}

impl ImageInput {
    /// For a tower of `config`, with the processor settings of `dir` (defaults where it has none).
    pub fn new(dir: &Path, config: &tern_model::vision::VisionConfig) -> Result<ImageInput> {
        let mut params = tern_model::vision::ImageParams::from_dir(dir)?;
        params.patch_size = config.patch_size;
        params.merge_size = config.spatial_merge_size;
        params.temporal_patch_size = config.temporal_patch_size;
        Ok(ImageInput { params, image_token_id: config.image_token_id })
    }

    /// Image tokens of preprocessed `pixels` ([`tern_model::vision::Pixels::tokens`] at the merge size).
    pub fn tokens(&self, pixels: &tern_model::vision::Pixels) -> usize {
        pixels.tokens(self.params.merge_size)
    }
}

impl Model {
    /// Load a model directory onto the CPU backend, in 4 bits as the product runs: a bf16 checkpoint is
    /// quantised on load, an mlx one is used as stored.
    pub fn load_cpu(dir: &Path) -> Result<Model> {
        Model::load_cpu_with(dir, false)
    }

    /// [`Model::load_cpu`], with the MTP block's state kept beside every sequence when `speculative` (and the
    /// checkpoint has one: [`Backend::max_drafts`] says).
    pub fn load_cpu_with(dir: &Path, speculative: bool) -> Result<Model> {
        let weights = tern_model::Weights::load_with(dir, tern_model::LoadOptions { quantize: true })?;
        let images = weights.vision.as_ref().map(|v| ImageInput::new(dir, &v.config)).transpose()?;
        let model = Model::with_backend(dir, Arc::new(CpuBackend::new(weights).speculative(speculative)))?;
        Ok(Model { images, ..model })
    }

    /// A model over `backend`, which reads no images (set [`Model::images`] for one that does).
    pub fn with_backend(dir: &Path, backend: Arc<dyn Backend>) -> Result<Model> {
        let tokenizer =
            Tokenizer::from_dir(dir).with_context(|| format!("loading the tokenizer of {}", dir.display()))?;
        let template = ChatTemplate::from_dir(dir)?;
        let sampling = if dir.join("generation_config.json").exists() {
            SamplingParams::from_generation_config(dir)?
        } else {
            SamplingParams::default()
        };
        let stop_ids = stop_ids(dir)?;
        let name = dir
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "tern".into());
        Ok(Model {
            dir: dir.to_path_buf(),
            name,
            backend,
            tokenizer: Arc::new(tokenizer),
            template: Arc::new(template),
            sampling,
            stop_ids,
            images: None,
        })
    }
}

/// `eos_token_id` of generation_config.json (one id or a list), else the model's default stop ids.
fn stop_ids(dir: &Path) -> Result<Vec<u32>> {
    let path = dir.join("generation_config.json");
    if !path.exists() {
        return Ok(DEFAULT_STOP_IDS.to_vec());
    }
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?;
    Ok(match &v["eos_token_id"] {
        serde_json::Value::Array(a) => a.iter().filter_map(|x| x.as_u64().map(|x| x as u32)).collect(),
        serde_json::Value::Number(n) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        _ => DEFAULT_STOP_IDS.to_vec(),
    })
}

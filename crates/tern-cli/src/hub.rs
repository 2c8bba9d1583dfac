//! Model resolution (`--model DIR_OR_ID`) and `tern pull ID`: a local directory, else a Hugging Face model id
//! found in the local HF cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`; layout
//! `models--ORG--NAME/snapshots/<refs/main>/`), else downloaded into that cache with `hf-hub`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::Value;

#[derive(clap::Args)]
pub struct Args {
    /// Hugging Face model id, e.g. mlx-community/Qwen3.6-35B-A3B-4bit.
    pub id: String,
}

/// `tern pull ID`: make sure the model is in the local cache and print its directory.
pub fn run(args: Args) -> Result<()> {
    let dir = resolve_model(&args.id)?;
    println!("{}", dir.display());
    Ok(())
}

/// A model directory for `arg`: the directory itself, or the cached / downloaded snapshot of a model id.
pub fn resolve_model(arg: &str) -> Result<PathBuf> {
    let p = Path::new(arg);
    if p.is_dir() {
        return Ok(p.to_path_buf());
    }
    if !is_repo_id(arg) {
        bail!("--model {arg}: no such directory, and not a Hugging Face model id (ORG/NAME)");
    }
    let cache = hub_cache_dir(
        std::env::var_os("HF_HUB_CACHE").map(PathBuf::from),
        std::env::var_os("HF_HOME").map(PathBuf::from),
        std::env::var_os("HOME").map(PathBuf::from),
    )?;
    if let Some(dir) = cached_snapshot(&cache, arg) {
        return Ok(dir);
    }
    download(&cache, arg)
}

fn is_repo_id(s: &str) -> bool {
    let ok = |part: &str| !part.is_empty() && part.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    matches!(s.split_once('/'), Some((org, name)) if ok(org) && ok(name) && !name.contains('/'))
}

/// The hub cache directory from `HF_HUB_CACHE`, `HF_HOME` and `HOME` (in that order of precedence).
pub fn hub_cache_dir(
    hf_hub_cache: Option<PathBuf>,
    hf_home: Option<PathBuf>,
    home: Option<PathBuf>,
) -> Result<PathBuf> {
    if let Some(d) = hf_hub_cache {
        return Ok(d);
    }
    if let Some(d) = hf_home {
        return Ok(d.join("hub"));
    }
    let home = home.context("cannot find the Hugging Face cache: HF_HUB_CACHE, HF_HOME and HOME are all unset")?;
    Ok(home.join(".cache/huggingface/hub"))
}

/// The snapshot of `id` at `refs/main` in `cache`, if it is complete (config.json and every safetensors file
/// its index names, or model.safetensors).
pub fn cached_snapshot(cache: &Path, id: &str) -> Option<PathBuf> {
    let repo = cache.join(format!("models--{}", id.replace('/', "--")));
    let rev = std::fs::read_to_string(repo.join("refs/main")).ok()?;
    let dir = repo.join("snapshots").join(rev.trim());
    (dir.join("config.json").is_file() && weight_files(&dir).ok()?.iter().all(|f| dir.join(f).is_file())).then_some(dir)
}

/// The safetensors files a snapshot directory needs, from its index (or `model.safetensors`).
fn weight_files(dir: &Path) -> Result<Vec<String>> {
    let index = dir.join("model.safetensors.index.json");
    if !index.is_file() {
        return Ok(vec!["model.safetensors".into()]);
    }
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&index)?)?;
    let mut files: Vec<String> = v["weight_map"]
        .as_object()
        .with_context(|| format!("{}: no weight_map", index.display()))?
        .values()
        .filter_map(|f| f.as_str().map(str::to_owned))
        .collect();
    files.sort();
    files.dedup();
    Ok(files)
}

/// Files a model directory needs besides the weights.
const SIDE_FILES: [&str; 5] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
];

fn download(cache: &Path, id: &str) -> Result<PathBuf> {
    let offline = || {
        format!(
            "model {id} is not in the Hugging Face cache {} and could not be downloaded from huggingface.co \
             (offline? pass a local directory, or run `tern pull {id}` where the network is reachable)",
            cache.display()
        )
    };
    let api = hf_hub::api::sync::ApiBuilder::from_env()
        .with_cache_dir(cache.to_path_buf())
        .with_progress(true)
        .build()
        .with_context(offline)?;
    let repo = api.model(id.to_owned());
    let info = repo.info().with_context(offline)?;
    let listed: Vec<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
    if !listed.contains(&"config.json") {
        bail!("{id}: the repository has no config.json (not a model repository?)");
    }
    let config = repo.get("config.json").with_context(|| format!("{id}: downloading config.json"))?;
    let dir = config.parent().context("hf-hub returned a file without a directory")?.to_path_buf();
    let wanted = ["model.safetensors.index.json"].into_iter().chain(SIDE_FILES).filter(|f| listed.contains(f));
    for f in wanted {
        repo.get(f).with_context(|| format!("{id}: downloading {f}"))?;
    }
    for f in weight_files(&dir)? {
        eprintln!("{id}: {f}");
        repo.get(&f).with_context(|| format!("{id}: downloading {f}"))?;
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_dir_precedence() {
        let p = |s: &str| Some(PathBuf::from(s));
        assert_eq!(hub_cache_dir(p("/c"), p("/h"), p("/home/u")).unwrap(), PathBuf::from("/c"));
        assert_eq!(hub_cache_dir(None, p("/h"), p("/home/u")).unwrap(), PathBuf::from("/h/hub"));
        assert_eq!(hub_cache_dir(None, None, p("/home/u")).unwrap(), PathBuf::from("/home/u/.cache/huggingface/hub"));
        assert!(hub_cache_dir(None, None, None).is_err());
    }

    #[test]
    fn resolves_from_a_fake_cache() {
        let cache = std::env::temp_dir().join(format!("tern-hub-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&cache);
        let repo = cache.join("models--org--Model-4bit");
        let snap = repo.join("snapshots/abc123");
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        assert_eq!(cached_snapshot(&cache, "org/Model-4bit"), None, "no refs/main yet");
        std::fs::write(repo.join("refs/main"), "abc123\n").unwrap();
        std::fs::write(snap.join("config.json"), "{}").unwrap();
        let index =
            r#"{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}"#;
        std::fs::write(snap.join("model.safetensors.index.json"), index).unwrap();
        std::fs::write(snap.join("model-00001-of-00002.safetensors"), "").unwrap();
        assert_eq!(cached_snapshot(&cache, "org/Model-4bit"), None, "a shard is missing");
        std::fs::write(snap.join("model-00002-of-00002.safetensors"), "").unwrap();
        assert_eq!(cached_snapshot(&cache, "org/Model-4bit"), Some(snap.clone()));
        assert_eq!(cached_snapshot(&cache, "org/other"), None);
        // Another revision in snapshots/ is ignored: refs/main decides.
        std::fs::write(repo.join("refs/main"), "def456").unwrap();
        assert_eq!(cached_snapshot(&cache, "org/Model-4bit"), None);
        std::fs::remove_dir_all(&cache).unwrap();
    }

    #[test]
    fn local_directories_and_ids() {
        let d = std::env::temp_dir();
        assert_eq!(resolve_model(d.to_str().unwrap()).unwrap(), d);
        assert!(is_repo_id("mlx-community/Qwen3.6-35B-A3B-4bit"));
        for bad in ["no-slash", "a/b/c", "/abs/path", "a/", "a b/c"] {
            assert!(!is_repo_id(bad), "{bad}");
        }
        let e = resolve_model("./definitely/not/here").unwrap_err().to_string();
        assert!(e.contains("no such directory"), "{e}");
    }
}

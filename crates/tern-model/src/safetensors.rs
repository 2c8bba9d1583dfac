//! Safetensors files: a memory-mapped reader that validates every header entry against the file, and a streaming
//! writer (tensors are produced one at a time, so checkpoints larger than RAM can be written).
//!
//! Format: `u64` little-endian header length N, N bytes of JSON `{name: {dtype, shape, data_offsets: [begin,
//! end]}, "__metadata__": {..}}`, then the data; offsets are relative to the end of the header.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use memmap2::Mmap;
use serde_json::{json, Map, Value};

use crate::quant::{Plain, SharedBytes, Slab};

/// Element types tern reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32,
    F16,
    BF16,
    U32,
    I32,
    U8,
}

impl Dtype {
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 | Dtype::U32 | Dtype::I32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            Dtype::U8 => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "F32",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::U32 => "U32",
            Dtype::I32 => "I32",
            Dtype::U8 => "U8",
        }
    }

    fn parse(s: &str) -> Option<Dtype> {
        Some(match s {
            "F32" => Dtype::F32,
            "F16" => Dtype::F16,
            "BF16" => Dtype::BF16,
            "U32" => Dtype::U32,
            "I32" => Dtype::I32,
            "U8" => Dtype::U8,
            _ => return None,
        })
    }
}

#[derive(Clone, Debug)]
struct Entry {
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// One memory-mapped safetensors file with a validated header.
pub struct SafeTensors {
    path: PathBuf,
    map: Arc<Mmap>,
    data_start: usize,
    entries: BTreeMap<String, Entry>,
}

/// A borrowed tensor: where it came from, its type, shape and raw little-endian bytes.
#[derive(Clone, Copy)]
pub struct TensorView<'a> {
    pub file: &'a Path,
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
    /// The mapped file and where `bytes` start in it, for zero-copy [`Slab`]s.
    map: &'a Arc<Mmap>,
    offset: usize,
}

impl SafeTensors {
    pub fn open(path: &Path) -> Result<SafeTensors> {
        let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        // SAFETY: the file is opened read-only and tern never writes to checkpoint files while they are mapped;
        // another process truncating it underneath us is outside what any mmap-based loader can defend against.
        let map = unsafe { Mmap::map(&file) }.with_context(|| format!("cannot map {}", path.display()))?;
        let fail = |msg: String| anyhow::anyhow!("{}: {msg}", path.display());
        if map.len() < 8 {
            return Err(fail(format!("file is {} bytes, too short for a safetensors header", map.len())));
        }
        let n = u64::from_le_bytes(map[..8].try_into().unwrap());
        if n > (map.len() - 8) as u64 {
            return Err(fail(format!(
                "header length {n} exceeds the file size {} (truncated or not a safetensors file)",
                map.len()
            )));
        }
        let n = n as usize;
        let header: Map<String, Value> =
            serde_json::from_slice(&map[8..8 + n]).map_err(|e| fail(format!("header is not valid JSON: {e}")))?;
        let data_start = 8 + n;
        let data_len = map.len() - data_start;
        let mut entries = BTreeMap::new();
        for (name, v) in header {
            if name == "__metadata__" {
                continue;
            }
            let bad = |what: &str| fail(format!("tensor {name}: {what}"));
            let dtype_s = v.get("dtype").and_then(Value::as_str).ok_or_else(|| bad("no dtype"))?;
            let dtype = Dtype::parse(dtype_s).ok_or_else(|| bad(&format!("unsupported dtype {dtype_s}")))?;
            let shape: Vec<usize> = v
                .get("shape")
                .and_then(Value::as_array)
                .ok_or_else(|| bad("no shape"))?
                .iter()
                .map(|d| d.as_u64().map(|d| d as usize))
                .collect::<Option<_>>()
                .ok_or_else(|| bad("shape is not a list of integers"))?;
            let offs = v.get("data_offsets").and_then(Value::as_array).ok_or_else(|| bad("no data_offsets"))?;
            let (start, end) = match (offs.first().and_then(Value::as_u64), offs.get(1).and_then(Value::as_u64)) {
                (Some(s), Some(e)) if offs.len() == 2 => (s as usize, e as usize),
                _ => return Err(bad("data_offsets is not [begin, end]")),
            };
            let numel =
                shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| bad("shape overflows"))?;
            let want = numel.checked_mul(dtype.size()).ok_or_else(|| bad("size overflows"))?;
            if start > end || end - start != want {
                return Err(bad(&format!(
                    "data_offsets [{start}, {end}] hold {} bytes but {dtype_s} {shape:?} needs {want}",
                    end.saturating_sub(start)
                )));
            }
            if end > data_len {
                return Err(bad(&format!(
                    "data ends at byte {end} but the file has only {data_len} data bytes (truncated file)"
                )));
            }
            entries.insert(name, Entry { dtype, shape, start, end });
        }
        Ok(SafeTensors { path: path.to_path_buf(), map: Arc::new(map), data_start, entries })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    pub fn get(&self, name: &str) -> Option<TensorView<'_>> {
        let (name, e) = self.entries.get_key_value(name)?;
        Some(TensorView {
            file: &self.path,
            name,
            dtype: e.dtype,
            shape: &e.shape,
            bytes: &self.map[self.data_start + e.start..self.data_start + e.end],
            map: &self.map,
            offset: self.data_start + e.start,
        })
    }
}

impl TensorView<'_> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The values as f32 (F32, F16 and BF16 tensors).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let b = self.bytes;
        Ok(match self.dtype {
            Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
            Dtype::F16 => b.chunks_exact(2).map(|c| half::f16::from_le_bytes(c.try_into().unwrap()).to_f32()).collect(),
            Dtype::BF16 => {
                b.chunks_exact(2).map(|c| half::bf16::from_le_bytes(c.try_into().unwrap()).to_f32()).collect()
            }
            d => bail!(
                "{}: tensor {} has dtype {}, expected a float type (F32, F16 or BF16)",
                self.file.display(),
                self.name,
                d.name()
            ),
        })
    }

    /// Elements `range` (in elements of the tensor's dtype) as f32 (F32, F16 and BF16 tensors): one expert of a
    /// stacked tensor without converting the whole tensor.
    pub fn to_f32_range(&self, range: Range<usize>) -> Result<Vec<f32>> {
        let size = self.dtype.size();
        if range.start > range.end || range.end > self.numel() {
            bail!("{}: tensor {}: elements {range:?} out of range", self.file.display(), self.name);
        }
        TensorView { bytes: &self.bytes[range.start * size..range.end * size], ..*self }.to_f32()
    }

    /// A zero-copy view of the data as `T` (`U32` for packed weights, `BF16` for scales and biases), sharing the
    /// mapped file.
    pub fn slab<T: Plain>(&self, dtype: Dtype) -> Result<Slab<T>> {
        if self.dtype != dtype {
            bail!(
                "{}: tensor {} has dtype {}, expected {}",
                self.file.display(),
                self.name,
                self.dtype.name(),
                dtype.name()
            );
        }
        let shared: SharedBytes = self.map.clone();
        Slab::from_shared(shared, self.offset..self.offset + self.bytes.len())
            .with_context(|| format!("{}: tensor {}", self.file.display(), self.name))
    }
}

/// A set of safetensors files read as one checkpoint: `model.safetensors`, or the shards named by
/// `model.safetensors.index.json`, or every `*.safetensors` file of the directory.
pub struct Checkpoint {
    pub dir: PathBuf,
    files: Vec<Arc<SafeTensors>>,
    index: BTreeMap<String, usize>,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let mut names: Vec<String> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .with_context(|| format!("cannot read {}", index_path.display()))?;
            let v: Value =
                serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", index_path.display()))?;
            let map = v
                .get("weight_map")
                .and_then(Value::as_object)
                .with_context(|| format!("{}: no weight_map object", index_path.display()))?;
            let mut files: Vec<String> = map.values().filter_map(|f| f.as_str().map(str::to_owned)).collect();
            files.sort();
            files.dedup();
            files
        } else if single.exists() {
            vec!["model.safetensors".to_owned()]
        } else {
            let mut files: Vec<String> = std::fs::read_dir(dir)
                .with_context(|| format!("cannot read model directory {}", dir.display()))?
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.ends_with(".safetensors"))
                .collect();
            files.sort();
            files
        };
        if names.is_empty() {
            bail!("no safetensors files in {}", dir.display());
        }
        names.retain(|n| !n.is_empty());
        let mut files = Vec::new();
        let mut index = BTreeMap::new();
        for (i, name) in names.iter().enumerate() {
            let st = SafeTensors::open(&dir.join(name))?;
            for t in st.names() {
                index.insert(t.to_owned(), i);
            }
            files.push(Arc::new(st));
        }
        Ok(Checkpoint { dir: dir.to_path_buf(), files, index })
    }

    pub fn get(&self, name: &str) -> Option<TensorView<'_>> {
        self.files[*self.index.get(name)?].get(name)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// The tensor, or an error naming it and the directory.
    pub fn require(&self, name: &str) -> Result<TensorView<'_>> {
        self.get(name).with_context(|| format!("missing tensor {name} in checkpoint {}", self.dir.display()))
    }
}

/// What the writer needs to know before the data: name, type and shape of each tensor, in file order.
#[derive(Clone, Debug)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    pub fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// Write a safetensors file whose tensors are produced one at a time by `fill(i, buffer)` (the buffer has exactly
/// `specs[i].bytes()` bytes), so a file larger than memory can be written.
pub fn write(
    path: &Path,
    specs: &[TensorSpec],
    metadata: &BTreeMap<String, String>,
    mut fill: impl FnMut(usize, &mut [u8]) -> Result<()>,
) -> Result<()> {
    let mut header = Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), json!(metadata));
    }
    let mut offset = 0usize;
    for s in specs {
        let n = s.bytes();
        header.insert(
            s.name.clone(),
            json!({"dtype": s.dtype.name(), "shape": s.shape, "data_offsets": [offset, offset + n]}),
        );
        offset += n;
    }
    let mut text = serde_json::to_vec(&Value::Object(header))?;
    while text.len() % 8 != 0 {
        text.push(b' ');
    }
    let file = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut w = BufWriter::with_capacity(1 << 22, file);
    w.write_all(&(text.len() as u64).to_le_bytes())?;
    w.write_all(&text)?;
    let mut buf = Vec::new();
    for (i, s) in specs.iter().enumerate() {
        buf.clear();
        buf.resize(s.bytes(), 0);
        fill(i, &mut buf).with_context(|| format!("writing tensor {}", s.name))?;
        w.write_all(&buf).with_context(|| format!("writing {}", path.display()))?;
    }
    w.flush().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Little-endian bytes of f32 values converted to `dtype` (F32, F16 or BF16).
pub fn encode_floats(values: &[f32], dtype: Dtype, out: &mut [u8]) -> Result<()> {
    match dtype {
        Dtype::F32 => out.chunks_exact_mut(4).zip(values).for_each(|(o, v)| o.copy_from_slice(&v.to_le_bytes())),
        Dtype::F16 => out
            .chunks_exact_mut(2)
            .zip(values)
            .for_each(|(o, v)| o.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes())),
        Dtype::BF16 => out
            .chunks_exact_mut(2)
            .zip(values)
            .for_each(|(o, v)| o.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes())),
        d => bail!("cannot encode floats as {}", d.name()),
    }
    Ok(())
}

/// Write small f32 tensors (e.g. logits) to one file.
pub fn write_f32(path: &Path, tensors: &[(&str, &[usize], &[f32])]) -> Result<()> {
    let specs: Vec<TensorSpec> = tensors
        .iter()
        .map(|(n, s, _)| TensorSpec { name: (*n).to_owned(), dtype: Dtype::F32, shape: s.to_vec() })
        .collect();
    for (n, s, v) in tensors {
        if s.iter().product::<usize>() != v.len() {
            bail!("tensor {n}: shape {s:?} does not match {} values", v.len());
        }
    }
    write(path, &specs, &BTreeMap::new(), |i, buf| encode_floats(tensors[i].2, Dtype::F32, buf))
}

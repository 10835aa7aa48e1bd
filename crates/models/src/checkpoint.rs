//! Model directories: `config.json`, safetensors weights (one file or shards with an index),
//! and MLX's affine quantization map.
//!
//! Two layouts load: mlx-community (affine-quantized or not, `language_model.model.*`) and
//! Hugging Face (`model.language_model.*`, or `model.*` for text-only checkpoints). The model
//! picks its tensors through a [`Weights`] view with the layout's prefix already applied.
//!
//! Loading is strict, as mlx-lm's and mlx-vlm's are: [`ModelDir`] records every tensor the
//! model reads, and [`ModelDir::refuse_unread`] refuses the checkpoint when one is left that
//! its family's [`Unread`] rule does not explain (a tensor the reference drops too). A
//! checkpoint with a tensor Quince does not know belongs to another model, or was converted
//! wrongly; running it without that tensor would answer as a different model.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use mlx::Array;
use mlx::quantized::QuantizedMatrix;
use serde_json::Value;

use cache::{Error, Result};

/// Why a family's checkpoint may hold a tensor its model leaves unread: the reference drops
/// it too. Given the tensor's full name and `config.json`; `None` refuses the load.
pub type Unread = fn(name: &str, config: &Value) -> Option<&'static str>;

/// A model directory on disk, its config parsed and its weights loaded lazily.
#[derive(Debug)]
pub struct ModelDir {
    /// The directory.
    pub path: PathBuf,
    /// `config.json` as JSON.
    pub config: Value,
    /// Every tensor of every shard, by name (data read when evaluated).
    tensors: HashMap<String, Array>,
    /// The names the model has read so far.
    read: Mutex<HashSet<String>>,
}

impl ModelDir {
    /// Reads `config.json` and opens the safetensors weights: the shards listed by
    /// `model.safetensors.index.json` when present, else every `model*.safetensors`.
    pub fn open(path: impl AsRef<Path>) -> Result<ModelDir> {
        let path = path.as_ref().to_path_buf();
        let config = read_json(&path.join("config.json"))?;
        let files = weight_files(&path)?;
        let mut tensors = HashMap::new();
        for file in files {
            let loaded = mlx::io::load_safetensors(&file).map_err(|e| Error::CorruptWeights {
                path: file.clone(),
                message: e.message().to_string(),
            })?;
            tensors.extend(loaded.tensors);
        }
        Ok(ModelDir { path, config, tensors, read: Mutex::default() })
    }

    /// Whether the checkpoint holds `name` (full name; asking reads nothing).
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Every tensor name of the checkpoint (asking reads nothing).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The shape of tensor `name`, if the checkpoint holds it (asking reads nothing).
    pub fn shape(&self, name: &str) -> Option<Vec<i32>> {
        self.tensors.get(name).map(Array::shape)
    }

    /// The tensor `name` (full name), recorded as read by the model.
    pub fn read(&self, name: &str) -> Result<Array> {
        let array = self
            .tensors
            .get(name)
            .cloned()
            .ok_or_else(|| Error::MissingTensor { name: name.into(), dir: self.path.clone() })?;
        self.read.lock().unwrap_or_else(|e| e.into_inner()).insert(name.to_string());
        Ok(array)
    }

    /// Refuses the checkpoint when a tensor the model did not read is left that `unread` does
    /// not explain, naming every such tensor. Call once the model is built.
    pub fn refuse_unread(&self, unread: Unread) -> Result<()> {
        let read = self.read.lock().unwrap_or_else(|e| e.into_inner());
        let names: BTreeSet<&str> = self
            .names()
            .filter(|name| !read.contains(*name) && unread(name, &self.config).is_none())
            .collect();
        if names.is_empty() {
            return Ok(());
        }
        Err(Error::UnusedTensors {
            dir: self.path.clone(),
            names: names.into_iter().map(String::from).collect(),
        })
    }

    /// The weights under `prefix` (e.g. `language_model.model.`), with the quantization map.
    pub fn weights(&self, prefix: &str) -> Result<Weights<'_>> {
        Ok(Weights {
            dir: self,
            prefix: prefix.to_string(),
            quantization: Quantization::from_config(&self.config)?,
        })
    }
}

/// Whether `name` lies under the top-level module `module` (`vision_tower.`), in either layout
/// (mlx's, or Hugging Face's under `model.`).
pub fn under(name: &str, module: &str) -> bool {
    name.strip_prefix("model.").unwrap_or(name).starts_with(module)
}

/// The name inside a decoder's text weights (`layers.3.self_attn.k_proj.weight`), when `name`
/// is one, in any of the layouts (`language_model.model.`, `model.language_model.`, `model.`).
pub fn text_part(name: &str) -> Option<&str> {
    ["language_model.model.", "model.language_model.", "model."]
        .iter()
        .find_map(|prefix| name.strip_prefix(prefix))
}

/// Reads and parses a JSON file, naming the file in errors.
pub fn read_json(path: &Path) -> Result<Value> {
    let text = fs::read_to_string(path)
        .map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    serde_json::from_str(&text)
        .map_err(|e| Error::Config { file: file_name(path), message: e.to_string() })
}

fn file_name(path: &Path) -> String {
    path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let json = read_json(&index)?;
        let map =
            json.get("weight_map").and_then(Value::as_object).ok_or_else(|| Error::Config {
                file: "model.safetensors.index.json".into(),
                message: "missing key `weight_map`".into(),
            })?;
        let mut files: Vec<PathBuf> =
            map.values().filter_map(Value::as_str).map(|f| dir.join(f)).collect();
        files.sort();
        files.dedup();
        for file in &files {
            if !file.is_file() {
                return Err(Error::MissingShard { path: file.clone() });
            }
        }
        return Ok(files);
    }
    let entries =
        fs::read_dir(dir).map_err(|source| Error::Io { path: dir.to_path_buf(), source })?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = file_name(p);
            name.starts_with("model") && name.ends_with(".safetensors")
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::MissingShard { path: dir.join("model.safetensors") });
    }
    Ok(files)
}

/// How one module is quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantSpec {
    /// Values per group.
    pub group_size: i32,
    /// Bits per value.
    pub bits: i32,
}

/// The `quantization` (or `quantization_config`) entry of `config.json`: defaults plus
/// per-module overrides, where `false` means "not quantized".
#[derive(Debug, Clone, Default)]
pub struct Quantization {
    default: Option<QuantSpec>,
    overrides: HashMap<String, Option<QuantSpec>>,
}

impl Quantization {
    fn from_config(config: &Value) -> Result<Quantization> {
        let Some(map) = config.get("quantization").or_else(|| config.get("quantization_config"))
        else {
            return Ok(Quantization::default());
        };
        let Some(map) = map.as_object() else {
            return Err(Error::Config {
                file: "config.json".into(),
                message: "`quantization` is not an object".into(),
            });
        };
        if let Some(mode) = map.get("mode").and_then(Value::as_str)
            && mode != "affine"
        {
            return Err(Error::Unsupported {
                key: "quantization.mode".into(),
                value: mode.into(),
                reason: "only affine quantization is supported".into(),
            });
        }
        let spec = |v: &Value| -> Option<QuantSpec> {
            Some(QuantSpec {
                group_size: v.get("group_size")?.as_i64()? as i32,
                bits: v.get("bits")?.as_i64()? as i32,
            })
        };
        let default = spec(&Value::Object(map.clone()));
        let mut overrides = HashMap::new();
        for (key, value) in map {
            match value {
                Value::Bool(false) => {
                    overrides.insert(key.clone(), None);
                }
                Value::Object(_) => {
                    if let Some(mode) = value.get("mode").and_then(Value::as_str)
                        && mode != "affine"
                    {
                        return Err(Error::Unsupported {
                            key: format!("quantization.{key}.mode"),
                            value: mode.into(),
                            reason: "only affine quantization is supported".into(),
                        });
                    }
                    overrides.insert(key.clone(), spec(value));
                }
                _ => {}
            }
        }
        Ok(Quantization { default, overrides })
    }

    /// The spec a config names for `path` (full tensor path without `.weight`), if any.
    fn named(&self, path: &str) -> Option<Option<QuantSpec>> {
        self.overrides.get(path).copied()
    }
}

/// A view of a model directory's tensors under one prefix.
#[derive(Debug)]
pub struct Weights<'a> {
    dir: &'a ModelDir,
    prefix: String,
    quantization: Quantization,
}

impl Weights<'_> {
    /// Whether `name` (relative to the prefix) exists.
    pub fn contains(&self, name: &str) -> bool {
        self.dir.contains(&self.full(name))
    }

    fn full(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// The tensor `name`, whatever its shape (the caller checks it).
    pub fn tensor(&self, name: &str) -> Result<Array> {
        self.dir.read(&self.full(name))
    }

    /// The tensor `name`, checked against `shape`.
    pub fn get(&self, name: &str, shape: &[i32]) -> Result<Array> {
        let full = self.full(name);
        let array = self.tensor(name)?;
        let actual = array.shape();
        if actual != shape {
            return Err(Error::TensorShape { name: full, actual, expected: shape.to_vec() });
        }
        Ok(array)
    }

    /// A matrix `[rows, cols]` (a linear layer's `[out, in]` or an embedding table), quantized
    /// when `<module>.scales` exists. Group size and bits come from the config's map for this
    /// module, else its defaults, else the shapes; the shapes must agree in every case.
    pub fn matrix(&self, module: &str, rows: i32, cols: i32) -> Result<Matrix> {
        self.matrices(module, &[], rows, cols)
    }

    /// [`Weights::matrix`] for a stack of matrices `[lead…, rows, cols]` (a mixture-of-experts
    /// layer's `[experts, out, in]`), quantized matrix by matrix along the last axis.
    pub fn matrices(&self, module: &str, lead: &[i32], rows: i32, cols: i32) -> Result<Matrix> {
        let shape = |last: &[i32]| -> Vec<i32> { lead.iter().chain(last).copied().collect() };
        let weight_name = format!("{module}.weight");
        let scales_name = format!("{module}.scales");
        let full_module = self.full(module);
        if !self.contains(&scales_name) {
            return Ok(Matrix::Dense(self.get(&weight_name, &shape(&[rows, cols]))?));
        }
        let named = self.quantization.named(&full_module).or_else(|| {
            // mlx-lm writes override keys without the `language_model.model.` style prefix too.
            self.quantization.named(module)
        });
        if matches!(named, Some(None)) {
            return Err(Error::Config {
                file: "config.json".into(),
                message: format!(
                    "`quantization.{full_module}` is false but {full_module}.scales exists"
                ),
            });
        }
        let missing =
            |name: &str| Error::MissingTensor { name: self.full(name), dir: self.dir.path.clone() };
        let raw_weight =
            self.dir.shape(&self.full(&weight_name)).ok_or_else(|| missing(&weight_name))?;
        let scales =
            self.dir.shape(&self.full(&scales_name)).ok_or_else(|| missing(&scales_name))?;
        let packed_cols = raw_weight.last().copied().unwrap_or(0);
        let groups = scales.last().copied().unwrap_or(0);
        let inferred =
            QuantSpec { group_size: cols / groups.max(1), bits: 32 * packed_cols / cols.max(1) };
        let spec = named.flatten().or(self.quantization.default).unwrap_or(inferred);
        if spec != inferred || cols % spec.group_size != 0 {
            return Err(Error::TensorShape {
                name: self.full(&weight_name),
                actual: raw_weight,
                expected: shape(&[rows, cols * spec.bits / 32]),
            });
        }
        if ![2, 3, 4, 5, 6, 8].contains(&spec.bits) || ![32, 64, 128].contains(&spec.group_size) {
            return Err(Error::Unsupported {
                key: format!("quantization of {full_module}"),
                value: format!("bits {} group {}", spec.bits, spec.group_size),
                reason: "affine bits 2/3/4/5/6/8 with groups 32/64/128".into(),
            });
        }
        let weight = self.get(&weight_name, &shape(&[rows, cols * spec.bits / 32]))?;
        let scales = self.get(&scales_name, &shape(&[rows, cols / spec.group_size]))?;
        let groups = shape(&[rows, cols / spec.group_size]);
        let biases = self.get(&format!("{module}.biases"), &groups)?;
        Ok(Matrix::Quantized(QuantizedMatrix {
            weight,
            scales,
            biases,
            group_size: spec.group_size,
            bits: spec.bits,
        }))
    }
}

/// A weight matrix, dense or affine-quantized.
#[derive(Debug, Clone)]
pub enum Matrix {
    /// Floating point `[rows, cols]`.
    Dense(Array),
    /// Packed with per-group scales and biases.
    Quantized(QuantizedMatrix),
}

impl Matrix {
    /// The matrices one above the other (`[Σ rows, cols]`), as one product computes all their
    /// outputs: `None` when they cannot be one matrix (dense next to quantized, different bits,
    /// group sizes, dtypes or columns). Lazy: the parts are read and joined when first used.
    pub fn stack_rows(parts: &[Matrix]) -> Result<Option<Matrix>> {
        let same =
            |a: &Array, b: &Array| a.dtype() == b.dtype() && a.dim(-1).ok() == b.dim(-1).ok();
        let joined =
            |arrays: Vec<&Array>| -> Result<Array> { Ok(mlx::ops::concatenate(&arrays, 0)?) };
        match parts {
            [] => Ok(None),
            [Matrix::Dense(first), ..] => {
                let mut dense = Vec::with_capacity(parts.len());
                for part in parts {
                    match part {
                        Matrix::Dense(w) if same(w, first) => dense.push(w),
                        _ => return Ok(None),
                    }
                }
                Ok(Some(Matrix::Dense(joined(dense)?)))
            }
            [Matrix::Quantized(first), ..] => {
                let mut quantized = Vec::with_capacity(parts.len());
                for part in parts {
                    match part {
                        Matrix::Quantized(q)
                            if q.bits == first.bits
                                && q.group_size == first.group_size
                                && same(&q.weight, &first.weight)
                                && same(&q.scales, &first.scales)
                                && same(&q.biases, &first.biases) =>
                        {
                            quantized.push(q);
                        }
                        _ => return Ok(None),
                    }
                }
                Ok(Some(Matrix::Quantized(QuantizedMatrix {
                    weight: joined(quantized.iter().map(|q| &q.weight).collect())?,
                    scales: joined(quantized.iter().map(|q| &q.scales).collect())?,
                    biases: joined(quantized.iter().map(|q| &q.biases).collect())?,
                    group_size: first.group_size,
                    bits: first.bits,
                })))
            }
        }
    }

    /// Output rows.
    pub fn rows(&self) -> Result<i32> {
        Ok(match self {
            Matrix::Dense(w) => w.dim(0)?,
            Matrix::Quantized(q) => q.weight.dim(0)?,
        })
    }

    /// Bytes the matrix occupies (packed weights, scales and biases for a quantized one): what
    /// a matrix-vector product reads.
    pub fn nbytes(&self) -> usize {
        match self {
            Matrix::Dense(w) => w.nbytes(),
            Matrix::Quantized(q) => q.weight.nbytes() + q.scales.nbytes() + q.biases.nbytes(),
        }
    }
}

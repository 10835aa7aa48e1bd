//! safetensors files: load (lazily, arrays read when evaluated) and save, with metadata.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use mlx_sys::ffi;

use crate::array::{Array, to_vector};
use crate::error::{Error, Result, check};

/// The tensors and string metadata of a safetensors file.
#[derive(Debug, Clone, Default)]
pub struct Safetensors {
    /// Tensors by name.
    pub tensors: HashMap<String, Array>,
    /// The `__metadata__` string map.
    pub metadata: HashMap<String, String>,
}

fn path_str(path: &Path) -> Result<&str> {
    path.to_str().ok_or_else(|| Error::invalid(format!("path is not UTF-8: {}", path.display())))
}

/// Loads a safetensors file. A malformed header or a missing file is an error here; the tensor
/// data itself is read when the arrays are evaluated.
#[track_caller]
pub fn load_safetensors(path: impl AsRef<Path>) -> Result<Safetensors> {
    let path = path.as_ref();
    let data = check(ffi::load_safetensors(path_str(path)?))?;
    let data = data.as_ref().unwrap_or_else(|| unreachable!("load returns an error, not null"));
    let mut tensors = HashMap::new();
    for name in ffi::safetensors_names(data) {
        let array = check(ffi::safetensors_get(data, &name))?;
        tensors.insert(name, Array::wrap(array));
    }
    let metadata = ffi::safetensors_metadata(data).into_iter().map(|p| (p.key, p.value)).collect();
    Ok(Safetensors { tensors, metadata })
}

/// Saves `tensors` (evaluating them) with `metadata` to `path`.
#[track_caller]
pub fn save_safetensors(
    path: impl AsRef<Path>,
    tensors: &BTreeMap<String, Array>,
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let path = path.as_ref();
    let names: Vec<String> = tensors.keys().cloned().collect();
    let arrays = to_vector(tensors.values());
    let metadata: Vec<ffi::StringPair> = metadata
        .iter()
        .map(|(key, value)| ffi::StringPair { key: key.clone(), value: value.clone() })
        .collect();
    check(ffi::save_safetensors(path_str(path)?, &names, &arrays, &metadata))
}

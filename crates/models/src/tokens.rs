//! Token ids as model inputs.

use mlx::Array;

use cache::Result;

/// Token ids `[1, T]` as an int32 array.
pub fn ids(tokens: &[u32]) -> Result<Array> {
    let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    Ok(Array::from_slice(&ids, &[1, ids.len() as i32])?)
}

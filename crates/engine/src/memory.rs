//! The memory guard: before a reply, the KV cache its prompt and longest reply could fill,
//! projected with the storage chosen, against a share of the memory MLX recommends for the
//! device, less what is in use already (the weights). A reply that would pass it is refused
//! before anything is computed, with the numbers and what to change. Beside replies decoding
//! in a batch, a reply that fits alone but not beside what they may still take waits for
//! them to end ([`Fit::AfterOthers`]).

use crate::cache::{CachePlan, KvOptions};
use crate::{Error, Result};

/// The share of the recommended memory a turn may fill when nothing else is said.
pub const DEFAULT_SHARE: f64 = 0.9;

/// The device's recommended memory, or `None` where MLX reports none.
pub fn recommended_bytes() -> Result<Option<u64>> {
    Ok(mlx::Device::default_device()?.recommended_memory()?)
}

/// Memory MLX holds for arrays alive now (the weights, caches, arrays in flight), in bytes.
pub fn in_use() -> Result<u64> {
    Ok(mlx::device::memory::active()? as u64)
}

/// The KV memory of the replies decoding beside a new one (a batch's rows).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Beside {
    /// Bytes their caches hold now (counted in MLX's active memory).
    pub held: u64,
    /// Bytes their caches may still take: each row's projection at its longest reply, less
    /// its projection now.
    pub growth: u64,
}

impl Beside {
    /// No other reply.
    pub const NONE: Beside = Beside { held: 0, growth: 0 };
}

/// When a turn's KV cache fits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fit {
    /// Now, beside what the other replies hold and may still take.
    Now,
    /// Only once replies decoding beside it have ended: it waits, and is never refused for it.
    AfterOthers {
        /// Its projected bytes.
        needed: u64,
        /// What the limit leaves it now, the other replies' growth set aside.
        available: u64,
    },
}

/// Whether a turn of `tokens` positions (prompt and longest reply), its KV cache under `plan`,
/// fits `share` of the recommended memory beside what is in use now and what the replies
/// decoding `beside` it may still take. A turn that would not fit even with those replies
/// gone is refused ([`Error::KvMemory`]); one that fits only once they end waits
/// ([`Fit::AfterOthers`]).
pub fn check_kv(
    plan: &CachePlan,
    kv: &KvOptions,
    tokens: usize,
    share: f64,
    beside: Beside,
) -> Result<Fit> {
    let Some(recommended) = recommended_bytes()? else {
        return Ok(Fit::Now);
    };
    let needed = plan.projected_bytes(tokens) as u64;
    let active = in_use()?;
    let limit = (share.clamp(0.0, 1.0) * recommended as f64) as u64;
    // Without the other replies: the weights and whatever else is alive.
    let in_use = active.saturating_sub(beside.held);
    let alone = limit.saturating_sub(in_use);
    if needed > alone {
        return Err(Error::KvMemory {
            needed,
            available: alone,
            share,
            recommended,
            in_use,
            tokens,
            storage: kv.describe(),
        });
    }
    let available = limit.saturating_sub(active).saturating_sub(beside.growth);
    Ok(if needed > available { Fit::AfterOthers { needed, available } } else { Fit::Now })
}

//! [`CachePlan`]: which storage each layer with state gets, decided by the model from its config
//! (the family's rule) and built in one place, so a new storage is one file and one
//! [`Layout`] variant or [`KvFormat`] here. A user's [`KvOptions`] turn the family's plan into
//! the plan of one reply ([`CachePlan::with_kv`]).

use serde::{Deserialize, Serialize};

use super::{
    Cache, DeltaShape, KvEncoding, KvFormat, PlainCache, PositionCache, RecurrentCache,
    RotatingCache,
};
use crate::backend::Ops;
use crate::error::{Error, Result};

/// Where a layer keeps its positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Every position, in a growing buffer ([`PlainCache`]).
    Plain,
    /// The last `window` positions, in a ring ([`RotatingCache`]).
    Rotating {
        /// Keys a query sees, itself included.
        window: usize,
    },
    /// No positions: a gated DeltaNet layer's recurrent state ([`RecurrentCache`]), the same
    /// size at every length. KV choices leave it as it is.
    GatedDelta(DeltaShape),
    /// No positions and no layer: where a multimodal-RoPE model's positions stand after its
    /// images ([`PositionCache`]), kept beside the layers' state.
    Positions,
}

/// One layer's storage: its layout and how it encodes keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Storage {
    /// Where positions live.
    pub layout: Layout,
    /// How they are encoded.
    pub kv: KvEncoding,
}

impl Storage {
    /// Every position, in full precision.
    pub fn plain() -> Storage {
        Storage { layout: Layout::Plain, kv: KvEncoding::full() }
    }

    /// The last `window` positions, in full precision.
    pub fn rotating(window: usize) -> Storage {
        Storage { layout: Layout::Rotating { window }, kv: KvEncoding::full() }
    }

    /// A gated DeltaNet layer's recurrent state.
    pub fn gated_delta(shape: DeltaShape) -> Storage {
        Storage { layout: Layout::GatedDelta(shape), kv: KvEncoding::full() }
    }

    /// A multimodal-RoPE model's position shift.
    pub fn positions() -> Storage {
        Storage { layout: Layout::Positions, kv: KvEncoding::full() }
    }

    /// An empty cache of this storage whose reads run `ops`.
    pub fn build(self, ops: &Ops) -> Result<Box<dyn Cache>> {
        Ok(match self.layout {
            Layout::Plain => Box::new(PlainCache::encoded(self.kv, ops)),
            Layout::Rotating { window } => Box::new(RotatingCache::encoded(window, self.kv, ops)?),
            Layout::GatedDelta(shape) => Box::new(RecurrentCache::new(shape)),
            Layout::Positions => Box::new(PositionCache::new()),
        })
    }

    /// Bytes one more position costs in a layer of `shape` once converted (one row).
    pub fn bytes_per_token(&self, shape: &KvShape) -> usize {
        match self.layout {
            Layout::GatedDelta(_) | Layout::Positions => 0,
            _ => shape.bytes(&self.kv.format),
        }
    }

    /// Bytes this layer holds after `tokens` positions: a ring holds at most its window, and
    /// storage converts once its start is reached (before, it holds full precision).
    pub fn projected_bytes(&self, shape: &KvShape, tokens: usize) -> usize {
        let held = match self.layout {
            Layout::Plain => tokens,
            Layout::Rotating { window } => tokens.min(window),
            Layout::GatedDelta(delta) => return delta.state_bytes(shape.dtype_bytes),
            Layout::Positions => return 0,
        };
        if tokens > 0 && tokens >= self.kv.start {
            held * shape.bytes(&self.kv.format)
        } else {
            held * shape.bytes(&KvFormat::Full)
        }
    }
}

/// The geometry of one layer's keys and values: what bytes per token are computed from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of a key and of a value.
    pub head_dim: usize,
    /// Bytes of one full-precision value (2 for bf16, 4 for f32).
    pub dtype_bytes: usize,
}

impl KvShape {
    /// Bytes one position of keys and values takes in `format`.
    pub fn bytes(&self, format: &KvFormat) -> usize {
        2 * self.kv_heads * format.bytes_per_vector(self.head_dim, self.dtype_bytes)
    }
}

/// Which layers a KV choice applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
#[serde(rename_all = "snake_case")]
pub enum KvLayers {
    /// Every layer with keys and values, sliding windows included.
    #[default]
    All,
    /// Full-attention layers only: sliding windows stay in full precision (what mlx-lm
    /// quantizes).
    Full,
}

/// A user's KV cache choice for a reply: the format, where it starts, which layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
#[serde(default)]
pub struct KvOptions {
    /// How keys and values are stored.
    pub format: KvFormat,
    /// Positions kept in full precision before the conversion (mlx-lm's `quantized_kv_start`).
    pub quantized_start: usize,
    /// The layers it applies to.
    pub layers: KvLayers,
}

impl KvOptions {
    /// Full precision everywhere (the default).
    pub fn full() -> KvOptions {
        KvOptions::default()
    }

    /// Whether this leaves every layer in full precision.
    pub fn is_full(&self) -> bool {
        self.format.is_full()
    }

    /// The choice in words, e.g. `4-bit KV cache` or `TurboQuant 3-bit KV cache after 1024
    /// tokens, full-attention layers only`.
    pub fn describe(&self) -> String {
        let format = match self.format {
            KvFormat::Full => return "a full-precision KV cache".into(),
            KvFormat::Affine { bits, .. } => format!("a {bits}-bit KV cache"),
            KvFormat::Turbo { key_bits, value_bits } if key_bits == value_bits => {
                format!("a TurboQuant {key_bits}-bit KV cache")
            }
            KvFormat::Turbo { key_bits, value_bits } => {
                format!("a TurboQuant {}-bit KV cache", f64::from(key_bits + value_bits) / 2.0)
            }
        };
        let start = match self.quantized_start {
            0 => String::new(),
            n => format!(" after {n} tokens"),
        };
        let layers = match self.layers {
            KvLayers::All => "",
            KvLayers::Full => ", full-attention layers only",
        };
        format!("{format}{start}{layers}")
    }
}

/// Per layer that keeps state, in layer order, its storage and the geometry of its keys and
/// values (KV-sharing layers keep none, so a plan can be shorter than the model's layer list).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachePlan {
    layers: Vec<Storage>,
    shapes: Vec<KvShape>,
}

impl CachePlan {
    /// A plan of these storages, one per layer with state, with each layer's geometry.
    pub fn new(layers: Vec<Storage>, shapes: Vec<KvShape>) -> CachePlan {
        CachePlan { layers, shapes }
    }

    /// Each layer's storage.
    pub fn layers(&self) -> &[Storage] {
        &self.layers
    }

    /// Each layer's geometry.
    pub fn shapes(&self) -> &[KvShape] {
        &self.shapes
    }

    /// This plan under a user's KV choice: each layer it applies to takes its format and
    /// start (sliding windows too unless `layers` is [`KvLayers::Full`]). Refused when the
    /// format does not fit a layer's head dimension.
    pub fn with_kv(&self, options: &KvOptions) -> Result<CachePlan> {
        let applies = |storage: &Storage| match storage.layout {
            Layout::GatedDelta(_) | Layout::Positions => false,
            Layout::Rotating { .. } => options.layers == KvLayers::All,
            Layout::Plain => true,
        };
        let mut layers = Vec::with_capacity(self.layers.len());
        for (storage, shape) in self.layers.iter().zip(&self.shapes) {
            if !applies(storage) {
                layers.push(*storage);
                continue;
            }
            let format = options.format.for_head_dim(shape.head_dim);
            format.validate(&[shape.head_dim])?;
            let kv = KvEncoding { format, start: options.quantized_start };
            layers.push(Storage { kv, ..*storage });
        }
        Ok(CachePlan { layers, shapes: self.shapes.clone() })
    }

    /// Whether a layer keeps recurrent state (which cannot be trimmed back to a prefix).
    pub fn has_recurrent_state(&self) -> bool {
        self.layers.iter().any(|s| matches!(s.layout, Layout::GatedDelta(_)))
    }

    /// Bytes the whole stack holds after `tokens` positions (one row).
    pub fn projected_bytes(&self, tokens: usize) -> usize {
        self.layers
            .iter()
            .zip(&self.shapes)
            .map(|(s, shape)| s.projected_bytes(shape, tokens))
            .sum()
    }

    /// Bytes one more position costs over the whole stack once converted (one row).
    pub fn bytes_per_token(&self) -> usize {
        self.layers.iter().zip(&self.shapes).map(|(s, shape)| s.bytes_per_token(shape)).sum()
    }

    /// The stack's storages, as a checkpoint records them (`;`-joined signatures).
    pub fn signature(&self) -> Result<String> {
        let caches = self.build(&Ops::mlx(), self.layers.len())?;
        Ok(caches.iter().map(|c| c.signature()).collect::<Vec<_>>().join(";"))
    }

    /// Fresh caches, one per layer, reading with `ops`; `expected` is how many layers the
    /// model keeps state for (a plan of another length is refused).
    pub fn build(&self, ops: &Ops, expected: usize) -> Result<Vec<Box<dyn Cache>>> {
        if self.layers.len() != expected {
            return Err(Error::InvalidRequest(format!(
                "a cache plan of {} layers for a model that keeps state in {expected}",
                self.layers.len()
            )));
        }
        self.layers.iter().map(|s| s.build(ops)).collect()
    }
}

//! Devices, the backend this build runs on, and memory accounting.

use mlx_sys::ffi;

use crate::error::{Result, check};

/// A kind of device. MLX picks the GPU by default when the build has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The host CPU.
    Cpu,
    /// The GPU (Metal on Apple Silicon, CUDA on NVIDIA).
    Gpu,
}

impl Device {
    fn to_ffi(self) -> ffi::DeviceKind {
        match self {
            Device::Cpu => ffi::DeviceKind::Cpu,
            Device::Gpu => ffi::DeviceKind::Gpu,
        }
    }

    /// Whether this device can run ops in this build.
    #[track_caller]
    pub fn is_available(self) -> Result<bool> {
        check(ffi::is_available(self.to_ffi()))
    }

    /// The device new ops run on unless told otherwise.
    #[track_caller]
    pub fn default_device() -> Result<Device> {
        check(ffi::default_device_kind())
            .map(|kind| if kind == ffi::DeviceKind::Gpu { Device::Gpu } else { Device::Cpu })
    }

    /// MLX's description of the device: name, architecture, memory size and, on CUDA,
    /// free memory and compute capability. Keys vary by backend.
    #[track_caller]
    pub fn info(self) -> Result<Vec<(String, String)>> {
        Ok(check(ffi::device_info(self.to_ffi()))?.into_iter().map(|p| (p.key, p.value)).collect())
    }

    /// Total memory of the device in bytes: what MLX reports (GPU memory on CUDA, unified
    /// memory on Apple Silicon), else, for the CPU, the host's physical RAM.
    #[track_caller]
    pub fn memory_size(self) -> Result<Option<u64>> {
        let info = self.info()?;
        let reported = info
            .iter()
            .find(|(key, _)| key == "total_memory" || key == "memory_size")
            .and_then(|(_, value)| value.parse().ok());
        let host = ffi::system_memory_bytes() as u64;
        Ok(reported.or((self == Device::Cpu && host > 0).then_some(host)))
    }
}

impl Device {
    /// The memory MLX recommends a process fill on this device, in bytes: Metal's
    /// `max_recommended_working_set_size` (the share of unified memory the GPU may wire), else
    /// the device's memory ([`Device::memory_size`]).
    #[track_caller]
    pub fn recommended_memory(self) -> Result<Option<u64>> {
        let info = self.info()?;
        let recommended = info
            .iter()
            .find(|(key, _)| key == "max_recommended_working_set_size")
            .and_then(|(_, value)| value.parse().ok());
        match recommended {
            Some(bytes) => Ok(Some(bytes)),
            None => self.memory_size(),
        }
    }
}

/// Which MLX backend this process runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// CPU only (the Linux `mlx-cpu` wheel).
    Cpu,
    /// NVIDIA GPUs (`mlx-cuda-*` wheels).
    Cuda,
    /// Apple Silicon GPUs.
    Metal,
}

impl Backend {
    /// The backend of the loaded libmlx (asked once per process: it cannot change, and the
    /// decode step asks for every fused kernel it builds).
    pub fn current() -> Backend {
        static CURRENT: std::sync::OnceLock<Backend> = std::sync::OnceLock::new();
        *CURRENT.get_or_init(|| match ffi::backend_name().as_str() {
            "cuda" => Backend::Cuda,
            "metal" => Backend::Metal,
            _ => Backend::Cpu,
        })
    }

    /// `cpu`, `cuda` or `metal`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
            Backend::Metal => "metal",
        }
    }

    /// Whether custom GPU kernels (`metal_kernel` / `cuda_kernel`) can run in this build.
    pub fn custom_kernels_available(self) -> bool {
        match self {
            Backend::Cuda => ffi::cuda_kernels_available(),
            Backend::Metal => ffi::metal_kernels_available(),
            Backend::Cpu => false,
        }
    }
}

/// How many ops MLX-CUDA records into one CUDA graph before launching it
/// (`MLX_MAX_OPS_PER_BUFFER`; MLX picks 20–50 by GPU), unless the environment already says.
/// MLX reads it once, when a GPU stream is first used: call this before any MLX op. A decode
/// step is thousands of small ops; how they are batched into graphs is host time per token
/// (measured in the README). No effect on other backends. Returns whether it set the variable
/// (false: the environment had chosen).
pub fn default_cuda_graph_ops(ops: u32) -> Result<bool> {
    check(ffi::set_env_default(CUDA_GRAPH_OPS_VAR, &ops.to_string()))
}

/// The environment variable [`default_cuda_graph_ops`] sets.
pub const CUDA_GRAPH_OPS_VAR: &str = "MLX_MAX_OPS_PER_BUFFER";

/// The version of the loaded libmlx, e.g. `0.32.4`.
pub fn version() -> String {
    ffi::mlx_version()
}

/// Waits for all scheduled work on the default stream to finish.
#[track_caller]
pub fn synchronize() -> Result<()> {
    check(ffi::synchronize())
}

/// A GPU stream, by MLX's index. MLX gives each thread its own default stream and only that
/// thread may evaluate on it; a [`GpuStream::new_shared`] stream may be evaluated on from any
/// thread (one at a time: the caller orders the threads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuStream {
    index: i32,
}

impl GpuStream {
    /// A new stream that any thread may evaluate on.
    #[track_caller]
    pub fn new_shared() -> Result<GpuStream> {
        Ok(GpuStream { index: check(ffi::new_shared_gpu_stream())? })
    }

    /// This thread's default GPU stream.
    #[track_caller]
    pub fn default_for_thread() -> Result<GpuStream> {
        Ok(GpuStream { index: check(ffi::default_gpu_stream())? })
    }

    /// Makes this stream the thread's default: the GPU ops it builds from now on run there.
    #[track_caller]
    pub fn make_default(self) -> Result<()> {
        check(ffi::set_default_gpu_stream(self.index))
    }

    /// Waits for everything scheduled on this stream.
    #[track_caller]
    pub fn synchronize(self) -> Result<()> {
        check(ffi::synchronize_gpu_stream(self.index))
    }
}

/// Memory accounting and limits of MLX's allocator.
pub mod memory {
    use super::*;

    /// Bytes held by live arrays.
    #[track_caller]
    pub fn active() -> Result<usize> {
        check(ffi::get_active_memory())
    }

    /// The largest `active()` seen since start or the last [`reset_peak`].
    #[track_caller]
    pub fn peak() -> Result<usize> {
        check(ffi::get_peak_memory())
    }

    /// Restarts peak tracking.
    #[track_caller]
    pub fn reset_peak() -> Result<()> {
        check(ffi::reset_peak_memory())
    }

    /// Bytes freed by arrays but kept by the allocator for reuse.
    #[track_caller]
    pub fn cache() -> Result<usize> {
        check(ffi::get_cache_memory())
    }

    /// The allocator's limit in bytes.
    #[track_caller]
    pub fn limit() -> Result<usize> {
        check(ffi::get_memory_limit())
    }

    /// Returns the reuse cache to the system.
    #[track_caller]
    pub fn clear_cache() -> Result<()> {
        check(ffi::clear_cache())
    }
}

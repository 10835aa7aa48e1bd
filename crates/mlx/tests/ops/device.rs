//! Devices, backend facts and memory accounting.

use mlx::device::{self, memory};
use mlx::{Backend, Device, Dtype, ops};

#[test]
fn backend_and_default_device_agree() {
    assert_eq!(device::version(), "0.32.4", "the pinned MLX is the one loaded");
    let gpu = Device::Gpu.is_available().unwrap();
    assert!(Device::Cpu.is_available().unwrap());
    assert_eq!(Backend::current() != Backend::Cpu, gpu, "a GPU backend has a GPU");
    let expected = if gpu { Device::Gpu } else { Device::Cpu };
    assert_eq!(Device::default_device().unwrap(), expected, "GPU by default when present");
    assert!(Device::Cpu.memory_size().unwrap().unwrap_or(0) > 1 << 30, "host RAM is known");
    if !gpu {
        assert!(!Backend::current().custom_kernels_available());
    }
}

#[test]
fn memory_accounting_follows_allocations() {
    memory::reset_peak().unwrap();
    let before = memory::active().unwrap();
    let big = ops::ones(&[16, 1024, 1024], Dtype::Float32).unwrap(); // 64 MiB
    big.eval().unwrap();
    let during = memory::active().unwrap();
    assert!(during >= before + (64 << 20), "active grew by the array: {before} -> {during}");
    assert!(memory::peak().unwrap() >= during);
    drop(big);
    let after = memory::active().unwrap();
    assert!(after < during, "freed: {during} -> {after}");
    memory::clear_cache().unwrap();
    assert_eq!(memory::cache().unwrap(), 0, "clear_cache empties the reuse cache");
    assert!(memory::limit().unwrap() > 0, "the allocator has a limit");
    device::synchronize().unwrap();
}

#[test]
fn cuda_graph_ops_default_yields_to_the_environment() {
    // Each nextest test runs in its own process, so the variable starts unset here.
    if std::env::var_os(mlx::device::CUDA_GRAPH_OPS_VAR).is_some() {
        return; // set by whoever runs the tests: the default must not override it (below)
    }
    assert!(mlx::device::default_cuda_graph_ops(100).unwrap());
    assert_eq!(std::env::var(mlx::device::CUDA_GRAPH_OPS_VAR).unwrap(), "100");
    assert!(!mlx::device::default_cuda_graph_ops(7).unwrap());
    assert_eq!(std::env::var(mlx::device::CUDA_GRAPH_OPS_VAR).unwrap(), "100");
}

#[test]
fn a_shared_gpu_stream_is_an_error_without_a_gpu() {
    if Device::Gpu.is_available().unwrap() {
        // With a GPU: builds made on a shared stream run there.
        let thread_default = device::GpuStream::default_for_thread().unwrap();
        let shared = device::GpuStream::new_shared().unwrap();
        assert_ne!(shared, thread_default);
        shared.make_default().unwrap();
        let x = ops::ones(&[4], Dtype::Float32).unwrap().sum_all(false).unwrap();
        let value = std::thread::spawn(move || x.item::<f32>().unwrap()).join().unwrap();
        assert_eq!(value, 4.0, "another thread evaluated on the shared stream");
        shared.synchronize().unwrap();
        thread_default.make_default().unwrap();
        return;
    }
    assert!(device::GpuStream::new_shared().is_err());
    assert!(device::GpuStream::default_for_thread().is_err());
}

//! The CUDA kernels of tern as embedded sm_90a cubins (see `cuda/*.cu` and `build.rs`).
//!
//! [`CUBINS`] is empty when the crate was built without `nvcc` (a cargo warning says so); users must then
//! report that no kernels are available instead of trying to load any.

include!(concat!(env!("OUT_DIR"), "/cubins.rs"));

/// The cubin named `name` (file stem of its `.cu`), if it was built.
pub fn cubin(name: &str) -> Option<&'static [u8]> {
    CUBINS.iter().find(|(n, _)| *n == name).map(|(_, b)| *b)
}

/// Whether this build carries kernels at all.
pub fn available() -> bool {
    !CUBINS.is_empty()
}

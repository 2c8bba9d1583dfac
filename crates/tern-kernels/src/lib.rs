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

#[cfg(test)]
mod tests {
    /// ptxas' resource report of every kernel file (`-Xptxas -v`), as build.rs wrote it; empty without nvcc.
    const PTXAS_REPORT: &str = include_str!(concat!(env!("OUT_DIR"), "/ptxas-report.txt"));

    /// Each kernel's (stack frame, spill stores) in bytes from [`PTXAS_REPORT`]: its "Function properties for NAME"
    /// line, then "N bytes stack frame, M bytes spill stores, ...".
    fn frames() -> Vec<(&'static str, u32, u32)> {
        let mut out = Vec::new();
        let mut name = None;
        for line in PTXAS_REPORT.lines() {
            if let Some(i) = line.find("Function properties for ") {
                name = Some(line[i + "Function properties for ".len()..].trim());
            } else if let (Some(n), Some(i)) = (name, line.find(" bytes stack frame, ")) {
                let stack = line[..i].split_whitespace().last().and_then(|v| v.parse().ok());
                let spill = line[i + " bytes stack frame, ".len()..].split(' ').next().and_then(|v| v.parse().ok());
                if let (Some(a), Some(b)) = (stack, spill) {
                    out.push((n, a, b));
                }
                name = None;
            }
        }
        out
    }

    /// The kernels that have a stack frame or spill today, with those bytes; every other kernel must have neither.
    /// A runtime index into a small array, or a register limit too tight, moves values to local memory, which costs
    /// a kernel on the critical path several percent (a tile's tokens as `uint4 rows[2]` in moe_seqs.cu slowed the
    /// batched decode step 2-3%, docs/decisions.md, step 41). Growing an entry here is a decision, measured on the device.
    const ALLOWED: &[(&str, u32, u32)] = &[
        ("attn_prep_seqs", 32, 0),
        ("attn_prep", 32, 0),
        ("attn_prep_rows", 32, 0),
        ("gdn_step_seqs", 16, 16),
        ("gdn_verify_seqs", 8, 4),
        ("router_topk_q8", 32, 0),
        ("moe_gate_up", 16, 0),
        ("dense_ring_n8", 48, 72),
        ("sample_rows", 32, 32),
    ];

    #[test]
    fn no_kernel_gains_local_memory() {
        if !super::available() {
            println!("SKIPPED: no_kernel_gains_local_memory: built without nvcc (no ptxas report)");
            return;
        }
        let frames = frames();
        assert!(frames.len() >= 80, "only {} kernels in the ptxas report", frames.len());
        let mut over = Vec::new();
        for &(name, stack, spill) in &frames {
            let (max_stack, max_spill) = ALLOWED.iter().find(|a| a.0 == name).map_or((0, 0), |&(_, s, p)| (s, p));
            if stack > max_stack || spill > max_spill {
                over.push(format!("{name}: {stack} bytes stack frame, {spill} bytes spill stores"));
            }
        }
        assert!(over.is_empty(), "kernels with more local memory than allowed:\n{}", over.join("\n"));
    }
}

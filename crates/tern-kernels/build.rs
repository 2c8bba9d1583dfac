//! Compiles every `cuda/*.cu` with nvcc to an sm_90a cubin and embeds it (`CUBINS` in `cubins.rs`).
//!
//! nvcc is found via `NVCC`, then `PATH`, then `CUDA_HOME`/`CUDA_PATH`, then the pip wheels
//! (`nvidia-cuda-nvcc` & co., see `.ci/install-nvcc`). Without nvcc the build succeeds with an empty `CUBINS`
//! and a cargo warning. The ptxas resource report goes to `$OUT_DIR/ptxas-report.txt`; with
//! `TERN_PTXAS_REPORT` set it is also printed as cargo warnings.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let src_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("cuda");
    println!("cargo:rerun-if-changed=cuda");
    for v in ["NVCC", "CUDA_HOME", "CUDA_PATH", "TERN_PTXAS_REPORT", "TERN_NO_KTRACE", "PATH"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    let mut sources: Vec<PathBuf> = std::fs::read_dir(&src_dir)
        .map(|d| {
            d.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "cu")).collect()
        })
        .unwrap_or_default();
    sources.sort();
    for s in &sources {
        println!("cargo:rerun-if-changed={}", s.display());
    }
    let mut entries = Vec::new();
    match find_nvcc() {
        None => {
            println!(
                "cargo:warning=tern-kernels: nvcc not found (NVCC, PATH, CUDA_HOME or the pip wheels, see \
                 .ci/install-nvcc): building without CUDA kernels"
            );
            // A path that never exists: cargo treats the script as stale and runs it again at every build, so once
            // nvcc is installed (e.g. into site-packages, which changes no tracked variable) a plain `cargo build`
            // compiles the kernels instead of keeping this empty set until `cargo clean`.
            println!("cargo:rerun-if-changed={}", out.join("nvcc-not-found-probe-again").display());
        }
        Some(nvcc) => {
            let mut report = String::new();
            for s in &sources {
                let stem = s.file_stem().unwrap().to_string_lossy().to_string();
                let cubin = out.join(format!("{stem}.cubin"));
                let mut cmd = Command::new(&nvcc.bin);
                cmd.args(["-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-Xptxas", "-v", "-std=c++17"]);
                if std::env::var_os("TERN_NO_KTRACE").is_some() {
                    cmd.arg("-DTERN_NO_KTRACE");
                }
                for inc in &nvcc.includes {
                    cmd.arg(format!("-I{}", inc.display()));
                }
                cmd.arg("-o").arg(&cubin).arg(s);
                let res = cmd.output().unwrap_or_else(|e| panic!("cannot run {}: {e}", nvcc.bin.display()));
                let text = format!("{}{}", String::from_utf8_lossy(&res.stdout), String::from_utf8_lossy(&res.stderr));
                if !res.status.success() {
                    panic!("nvcc failed on {}:\n{text}", s.display());
                }
                report.push_str(&format!("== {stem}\n{text}"));
                entries.push((stem, cubin));
            }
            std::fs::write(out.join("ptxas-report.txt"), &report).unwrap();
            if std::env::var_os("TERN_PTXAS_REPORT").is_some() {
                for line in report.lines() {
                    println!("cargo:warning={line}");
                }
            }
        }
    }
    let mut rs = String::from("/// `(file stem, sm_90a cubin)` of every kernel file; empty without nvcc.\n");
    rs.push_str("pub const CUBINS: &[(&str, &[u8])] = &[\n");
    for (stem, path) in &entries {
        rs.push_str(&format!("    ({stem:?}, include_bytes!({:?})),\n", path.display().to_string()));
    }
    rs.push_str("];\n");
    std::fs::write(out.join("cubins.rs"), rs).unwrap();
}

struct Nvcc {
    bin: PathBuf,
    /// Extra include directories (the pip wheels do not know their own headers' location).
    includes: Vec<PathBuf>,
}

fn works(bin: &Path) -> bool {
    Command::new(bin).arg("--version").output().is_ok_and(|o| o.status.success())
}

fn find_nvcc() -> Option<Nvcc> {
    let plain = |bin: PathBuf| works(&bin).then_some(Nvcc { bin, includes: Vec::new() });
    if let Some(p) = std::env::var_os("NVCC") {
        return plain(PathBuf::from(p));
    }
    if let Some(n) = plain(PathBuf::from("nvcc")) {
        return Some(n);
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = std::env::var_os(var) {
            if let Some(n) = plain(PathBuf::from(home).join("bin/nvcc")) {
                return Some(n);
            }
        }
    }
    if let Some(n) = plain(PathBuf::from("/usr/local/cuda/bin/nvcc")) {
        return Some(n);
    }
    // pip wheels: CUDA 13 puts everything under site-packages/nvidia/cu13/{bin,include}; CUDA 12 wheels use
    // one directory per package (nvidia/cuda_nvcc, nvidia/cuda_runtime, ...).
    let py = "import nvidia, os; print('\\n'.join(os.path.abspath(p) for p in nvidia.__path__))";
    for python in ["python3", "python"] {
        let Ok(o) = Command::new(python).args(["-c", py]).output() else { continue };
        for root in String::from_utf8_lossy(&o.stdout).lines().map(PathBuf::from) {
            let cu13 = root.join("cu13");
            if works(&cu13.join("bin/nvcc")) {
                return Some(Nvcc { bin: cu13.join("bin/nvcc"), includes: vec![cu13.join("include")] });
            }
            let bin = root.join("cuda_nvcc/bin/nvcc");
            if works(&bin) {
                let includes = ["cuda_nvcc", "cuda_runtime", "cuda_cccl", "cuda_crt"]
                    .iter()
                    .map(|p| root.join(p).join("include"))
                    .filter(|p| p.exists())
                    .collect();
                return Some(Nvcc { bin, includes });
            }
        }
    }
    None
}

//! Compiles every `cuda/*.cu` with nvcc to an sm_90a cubin and embeds it (`CUBINS` in `cubins.rs`).
//!
//! nvcc is found via `NVCC`, then `PATH`, then `CUDA_HOME`/`CUDA_PATH`, then the pip wheels
//! (`nvidia-cuda-nvcc` & co., see `.ci/install-nvcc`). Without nvcc the build succeeds with an empty `CUBINS`
//! and a cargo warning. The ptxas resource report goes to `$OUT_DIR/ptxas-report.txt`; with
//! `TERN_PTXAS_REPORT` set it is also printed as cargo warnings. The files compile in parallel (one nvcc a core), and
//! the cubins are kept in `<target>/<profile>/tern-cubins/` for the next run of this script on the same sources, nvcc
//! and flags (`cargo clippy` then `cargo test` run it twice).

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
            std::fs::write(out.join("ptxas-report.txt"), "").unwrap();
        }
        Some(nvcc) => {
            let mut flags: Vec<String> =
                ["-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-Xptxas", "-v", "-std=c++17"]
                    .map(String::from)
                    .to_vec();
            if std::env::var_os("TERN_NO_KTRACE").is_some() {
                flags.push("-DTERN_NO_KTRACE".into());
            }
            for inc in &nvcc.includes {
                flags.push(format!("-I{}", inc.display()));
            }
            let stems: Vec<String> =
                sources.iter().map(|s| s.file_stem().unwrap().to_string_lossy().to_string()).collect();
            let cache = cache_dir(&out, &src_dir, &nvcc.bin, &flags);
            let report = match cache.as_ref().filter(|c| stems.iter().all(|st| c.join(format!("{st}.cubin")).exists()))
            {
                Some(c) => {
                    for st in &stems {
                        std::fs::copy(c.join(format!("{st}.cubin")), out.join(format!("{st}.cubin"))).unwrap();
                    }
                    std::fs::read_to_string(c.join("ptxas-report.txt")).unwrap_or_default()
                }
                None => {
                    let report = compile_all(&nvcc.bin, &flags, &sources, &stems, &out);
                    if let Some(c) = &cache {
                        store_cache(c, &stems, &out, &report);
                    }
                    report
                }
            };
            for st in &stems {
                entries.push((st.clone(), out.join(format!("{st}.cubin"))));
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

/// Runs nvcc on every source, as many at once as there are cores (the two largest files take half the time, so the
/// largest go first), and returns the ptxas reports in the sources' order.
fn compile_all(nvcc: &Path, flags: &[String], sources: &[PathBuf], stems: &[String], out: &Path) -> String {
    let mut order: Vec<usize> = (0..sources.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(std::fs::metadata(&sources[i]).map(|m| m.len()).unwrap_or(0)));
    let next = std::sync::Mutex::new(order.into_iter());
    let texts = std::sync::Mutex::new(vec![String::new(); sources.len()]);
    let jobs = std::thread::available_parallelism().map_or(1, |n| n.get()).min(sources.len().max(1));
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| loop {
                let Some(i) = next.lock().unwrap().next() else { break };
                let cubin = out.join(format!("{}.cubin", stems[i]));
                let res = Command::new(nvcc)
                    .args(flags)
                    .arg("-o")
                    .arg(&cubin)
                    .arg(&sources[i])
                    .output()
                    .unwrap_or_else(|e| panic!("cannot run {}: {e}", nvcc.display()));
                let text = format!("{}{}", String::from_utf8_lossy(&res.stdout), String::from_utf8_lossy(&res.stderr));
                if !res.status.success() {
                    panic!("nvcc failed on {}:\n{text}", sources[i].display());
                }
                texts.lock().unwrap()[i] = format!("== {}\n{text}", stems[i]);
            });
        }
    });
    texts.into_inner().unwrap().concat()
}

/// Where this build's cubins are kept for the next build of the same sources with the same nvcc and flags:
/// `<target>/<profile>/tern-cubins/<hash>/`. `cargo clippy` and `cargo build`/`test` run this script separately (the
/// clippy wrapper changes its fingerprint), so without it every kernel is compiled twice.
fn cache_dir(out: &Path, src_dir: &Path, nvcc: &Path, flags: &[String]) -> Option<PathBuf> {
    use std::hash::{Hash, Hasher};
    // OUT_DIR is <target>/<profile>/build/<package>-<hash>/out
    let profile_dir = out.ancestors().nth(3)?;
    let mut files: Vec<PathBuf> = std::fs::read_dir(src_dir).ok()?.filter_map(|e| e.ok()).map(|e| e.path()).collect();
    files.sort();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    nvcc.hash(&mut h);
    Command::new(nvcc).arg("--version").output().ok()?.stdout.hash(&mut h);
    flags.hash(&mut h);
    for f in &files {
        f.file_name().hash(&mut h);
        std::fs::read(f).ok()?.hash(&mut h);
    }
    Some(profile_dir.join("tern-cubins").join(format!("{:016x}", h.finish())))
}

/// Copies the fresh cubins and report into the cache: written under a temporary name, then renamed, so a build that
/// stops half way leaves no partial entry. Older entries are removed (one set of cubins a profile).
fn store_cache(dir: &Path, stems: &[String], out: &Path, report: &str) {
    if let Some(Ok(old)) = dir.parent().map(std::fs::read_dir) {
        for e in old.filter_map(|e| e.ok()) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
    let tmp = dir.with_extension(format!("tmp{}", std::process::id()));
    let copied = std::fs::create_dir_all(&tmp).is_ok()
        && stems.iter().all(|st| {
            let name = format!("{st}.cubin");
            std::fs::copy(out.join(&name), tmp.join(&name)).is_ok()
        })
        && std::fs::write(tmp.join("ptxas-report.txt"), report).is_ok();
    if !(copied && std::fs::rename(&tmp, dir).is_ok()) {
        let _ = std::fs::remove_dir_all(&tmp);
    }
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

//! The CUDA crate's modules import only downward (no import circle): each module may name only modules of a lower
//! layer. Read from the sources' `crate::<module>` paths (comments and `#[cfg(test)]` modules left out), so a new
//! upward import fails here with the line that makes it. A host test: no GPU needed.

use std::path::Path;

/// The layers, bottom up: the driver; the kernels' launch wrappers and the state pool; the few-row kernels (which
/// share the multi-token kernels' checks); the forward passes' workspace; the weights (which own the workspace);
/// the sequences' state; the forward pass; the engine's backend and the bench.
const LAYERS: &[&[&str]] = &[
    &["gpu"],
    &["prefill", "sample", "pool"],
    &["batch"],
    &["workspace"],
    &["model"],
    &["seq"],
    &["forward"],
    &["backend", "bench"],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

/// The code of a source file without its comments and its `#[cfg(test)]` module (the tests may reach anywhere).
fn code(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("#[cfg(test)]") {
            break;
        }
        let code = match line.find("//") {
            Some(c) => &line[..c],
            None => line,
        };
        out.push((i + 1, code.to_string()));
    }
    out
}

#[test]
fn modules_import_only_downward() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut seen = Vec::new();
    let mut wrong = Vec::new();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().to_string();
        if name == "lib" {
            continue;
        }
        let me = layer_of(&name).unwrap_or_else(|| panic!("src/{name}.rs is in no layer of LAYERS: add it"));
        seen.push(name.clone());
        let text = std::fs::read_to_string(&path).unwrap();
        for (line, code) in code(&text) {
            for (at, _) in code.match_indices("crate::") {
                let rest = &code[at + "crate::".len()..];
                let module: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                let Some(theirs) = layer_of(&module) else { continue };
                if module != name && theirs >= me {
                    wrong.push(format!(
                        "src/{name}.rs:{line} (layer {me}) names {module} (layer {theirs}): {}",
                        code.trim()
                    ));
                }
            }
        }
    }
    assert!(seen.len() >= 10, "read only {seen:?}");
    assert!(wrong.is_empty(), "imports that point up or sideways:\n{}", wrong.join("\n"));
    println!("{} modules in {} layers import only downward", seen.len(), LAYERS.len());
}

/// The check itself catches an upward import (it would pass vacuously if the parser found nothing).
#[test]
fn the_layering_check_sees_an_upward_import() {
    let fake = "use crate::gpu::Gpu;\n// crate::forward in a comment\nfn f() { crate::forward::x(); }\n#[cfg(test)]\nuse crate::backend;";
    let lines = code(fake);
    let names: Vec<String> = lines
        .iter()
        .flat_map(|(_, c)| {
            c.match_indices("crate::")
                .map(|(at, _)| c[at + 7..].split("::").next().unwrap().to_string())
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(names, ["gpu", "forward"]);
    assert!(layer_of("forward").unwrap() > layer_of("gpu").unwrap());
}

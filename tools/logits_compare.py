"""Compare `tern logits` outputs: python3 tools/logits_compare.py A.safetensors B.safetensors [C.safetensors ...]
Prints, for each file after the first, the per-position relative distance max|a-b|/max|b| to the first (median,
max) and the argmax agreement. Needs numpy and safetensors (both on the device image)."""
import sys
import numpy as np
from safetensors.numpy import load_file

ref = load_file(sys.argv[1])["logits"]
for path in sys.argv[2:]:
    x = load_file(path)["logits"]
    n = min(len(x), len(ref))
    d = np.abs(x[:n] - ref[:n]).max(axis=1) / np.abs(ref[:n]).max(axis=1)
    same = (x[:n].argmax(axis=1) == ref[:n].argmax(axis=1)).sum()
    print(f"{path} vs {sys.argv[1]}: {n} positions, distance median {np.median(d):.2e} max {d.max():.2e}, argmax {same}/{n}")

#!/usr/bin/env python3
"""Summarise Nsight Compute's per-instruction warp-stall sampling for one kernel launch.

Input: the source page of a report as CSV (`ncu --import R.ncu-rep --page source --csv --print-source sass`).
Prints the instructions with the most stall samples (their share, and the stall reasons sampled on them) and the
samples by opcode. Used by `tools/cuda-run.sh stalls`; standard library only.

  python3 tools/ncu_stalls.py source.csv [--top 40]
"""
import argparse
import collections
import csv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    rows = list(csv.reader(open(a.csv, errors="replace")))
    try:
        h = next(i for i, r in enumerate(rows) if "Source" in r and len(r) > 5)
    except StopIteration:
        print("no source table in", a.csv)
        return
    hdr = rows[h]
    src = hdr.index("Source")
    samp = next((i for i, c in enumerate(hdr) if c == "Warp Stall Sampling (All Samples)"), None)
    if samp is None:
        print("no stall-sampling column (profile with --section SourceCounters)")
        return
    stalls = [i for i, c in enumerate(hdr) if c.startswith("stall_") and "(Not" not in c]
    lines = []
    for r in rows[h + 1:]:
        if len(r) <= max([src, samp] + stalls):
            continue
        try:
            v = float(r[samp].replace(",", ""))
        except ValueError:
            continue
        lines.append((v, r[src].strip(), {hdr[i]: r[i] for i in stalls if r[i] not in ("", "0")}))
    total = sum(v for v, _, _ in lines) or 1.0
    print(f"{len(lines)} instructions, {total:.0f} stall samples")
    for v, s, why in sorted(lines, key=lambda x: -x[0])[: a.top]:
        reasons = " ".join(f"{k[6:]}={n}" for k, n in sorted(why.items(), key=lambda kv: -float(kv[1]))[:4])
        print(f"{v:8.0f} {100 * v / total:5.1f}%  {s[:64]:64s} {reasons}")
    ops = collections.Counter()
    for v, s, _ in lines:
        words = [w for w in s.split() if not w.startswith("@")]
        ops[words[0].split(".")[0] if words else "?"] += v
    print("by opcode:", ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in ops.most_common(12)))


if __name__ == "__main__":
    main()

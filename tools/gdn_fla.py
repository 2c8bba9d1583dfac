"""FLA's chunk_gated_delta_rule (pip fla-core) at the model's GDN shape: 16 key heads, 32 value heads, d 128, one
sequence, bf16 q/k/v, f32 gates and state, the l2 norm of q and k in the kernel. GPU time by CUDA-graph replay
(median of 5 runs of 20 replays), the figure issue 37 compares tern's gdn_prep + gdn_chunk_prep + gdn_chunk_scan
against (their summed device time, `tern bench`'s prefill profile).

    pip install --no-deps .whl/fla/*.whl && python3 tools/gdn_fla.py 4096 32768
"""
import sys

import torch
import torch.nn.functional as F
from fla.ops.gated_delta_rule import chunk_gated_delta_rule

H, HV, D = 16, 32, 128


def main():
    torch.manual_seed(0)
    for T in [int(a) for a in sys.argv[1:]] or [4096, 32768]:
        dev = "cuda"
        q = torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(1, T, HV, D, device=dev, dtype=torch.bfloat16)
        g = F.logsigmoid(torch.randn(1, T, HV, device=dev, dtype=torch.float32))
        beta = torch.rand(1, T, HV, device=dev, dtype=torch.bfloat16)
        h0 = torch.randn(1, HV, D, D, device=dev, dtype=torch.float32) * 0.01

        def run():
            return chunk_gated_delta_rule(
                q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
            )

        for _ in range(3):
            run()
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(20):
                graph.replay()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 20)
        times.sort()
        print(f"FLA chunk_gated_delta_rule T={T}: {times[2]:.3f} ms a layer (graph replay, median of 5; "
              f"min {times[0]:.3f}) on {torch.cuda.get_device_name()}", flush=True)


if __name__ == "__main__":
    main()

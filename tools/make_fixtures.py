#!/usr/bin/env python3
"""Write the reference fixtures: tiny random Qwen3.5/3.6-MoE checkpoints in the official layout, and the logits
Hugging Face transformers (the reference implementation) computes for them.

Usage (needs torch, transformers==5.17.0, safetensors; runs on CPU in seconds):

    python3 tools/make_fixtures.py OUT_DIR

For each fixture OUT_DIR/NAME/ holds:
    config.json, model*.safetensors[, model.safetensors.index.json]   the checkpoint (official names and layout)
    expected.safetensors   f32 tensors:
        ids           [T]     prompt ids (as f32; exact for small vocabularies)
        logits        [T, V]  one prefill of all ids, row i = logits after ids[0..=i]
        logits_split  [T, V]  prefill of ids[:split], then one token at a time through the cache
    meta.json              split, versions, and measured distances (transformers' own bf16 run vs f32, and
                           its prefill vs split runs)

Every parameter is random with scales that give O(1) activations (norm weights, A_log and dt_bias included),
so that a wrong formula cannot hide in near-zero values. The logits are computed in float32 from the weights
exactly as stored (bf16/f16 tensors are rounded first, then upcast), with eager attention and transformers'
torch fallbacks for the delta rule and the causal conv (flash-linear-attention must not be installed).
"""

import json
import math
import os
import sys

import torch

PINNED_TRANSFORMERS = "5.17.0"

import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration  # noqa: E402

# Shapes. Each one exercises something the real model has, at a size that keeps the fixtures small.
FIXTURES = [
    dict(
        name="tiny-a",  # the real 3+1 layer pattern, f32 on disk, one file
        dtype="float32",
        layout="fused",
        shard=None,
        seq=24,
        split=5,
        text=dict(
            hidden_size=64,
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000.0,
                partial_rotary_factor=0.25,
                mrope_interleaved=True,
                mrope_section=[2, 1, 1],
            ),
            partial_rotary_factor=0.25,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            vocab_size=384,
        ),
    ),
    dict(
        name="tiny-b",  # dk != dv, 3 value heads per key head, 2 key heads, other layer pattern, top-4,
        # prompt > 64 (crosses a delta-rule chunk), bf16 with f32 A_log / gated-norm weight, sharded per-expert
        # tensors as transformers 5.17 saves them
        dtype="bfloat16",
        layout="per-expert",
        shard="150KB",
        seq=80,
        split=67,
        text=dict(
            hidden_size=96,
            num_hidden_layers=5,
            layer_types=[
                "linear_attention",
                "full_attention",
                "linear_attention",
                "linear_attention",
                "full_attention",
            ],
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=64,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000000.0,
                partial_rotary_factor=0.5,
                mrope_interleaved=True,
                mrope_section=[6, 5, 5],
            ),
            partial_rotary_factor=0.5,
            linear_num_key_heads=2,
            linear_num_value_heads=6,
            linear_key_head_dim=16,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            vocab_size=512,
        ),
    ),
    dict(
        name="tiny-c",  # f16 on disk, full attention first, top-3 of 12, long prompt, split at 1
        dtype="float16",
        layout="fused",
        shard=None,
        seq=70,
        split=1,
        text=dict(
            hidden_size=64,
            num_hidden_layers=3,
            layer_types=["full_attention", "linear_attention", "linear_attention"],
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=1000.0,
                partial_rotary_factor=0.25,
                mrope_interleaved=True,
                mrope_section=[2, 1, 1],
            ),
            partial_rotary_factor=0.25,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=8,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            num_experts=12,
            num_experts_per_tok=3,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            vocab_size=300,
        ),
    ),
]

TINY_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=16,
)


def randomise(model, gen):
    """Give every text parameter an O(1)-activation random value."""
    for name, p in model.named_parameters():
        if name.startswith("model.visual."):
            continue
        shape = p.shape
        if name.endswith("A_log"):
            v = torch.empty(shape).uniform_(-1.5, 0.5, generator=gen)
        elif name.endswith("dt_bias"):
            v = torch.empty(shape).uniform_(-1.0, 1.0, generator=gen)
        elif name.endswith("linear_attn.norm.weight"):  # plain-weight gated norm
            v = torch.empty(shape).uniform_(0.5, 1.5, generator=gen)
        elif "norm" in name:  # the (1+w) norms: gains in 0.5..1.5
            v = torch.empty(shape).uniform_(-0.5, 0.5, generator=gen)
        elif name.endswith("conv1d.weight"):  # [C, 1, K]
            v = torch.randn(shape, generator=gen) * 0.5
        elif name.endswith("embed_tokens.weight"):
            v = torch.randn(shape, generator=gen)
        elif name.endswith("mlp.gate.weight"):  # router: spread-out expert probabilities
            v = torch.randn(shape, generator=gen) * (2.0 / math.sqrt(shape[-1]))
        else:  # Linear [out, in] and fused experts [E, out, in]: unit gain
            v = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        with torch.no_grad():
            p.copy_(v)


def rel_dist(a, b):
    """Per-position max|a-b| / max|b|."""
    return ((a - b).abs().amax(-1) / b.abs().amax(-1)).tolist()


def prefill_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids[None], use_cache=False).logits[0].float()


def split_logits(model, ids, split):
    with torch.no_grad():
        out = model(input_ids=ids[None, :split], use_cache=True)
        rows = [out.logits[0].float()]
        pkv = out.past_key_values
        for i in range(split, ids.shape[0]):
            out = model(input_ids=ids[None, i : i + 1], past_key_values=pkv, use_cache=True)
            pkv = out.past_key_values
            rows.append(out.logits[0].float())
    return torch.cat(rows, 0)


def make(fx, out_root, seed):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    text = dict(fx["text"], rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    vision = dict(TINY_VISION, out_hidden_size=text["hidden_size"])
    config = Qwen3_5MoeConfig(text_config=text, vision_config=vision)
    config.text_config._attn_implementation = "eager"
    model = Qwen3_5MoeForConditionalGeneration(config).float().eval()
    model.config._attn_implementation = "eager"
    randomise(model, gen)

    # Round every parameter to the fixture's storage dtype first (the official bf16 checkpoints keep A_log and
    # the gated-norm weight in f32), so the f32 model computes with exactly the values on disk.
    store = getattr(torch, fx["dtype"])

    def storage(name):
        keep_f32 = name.endswith("linear_attn.A_log") or name.endswith("linear_attn.norm.weight")
        return torch.float32 if keep_f32 and store == torch.bfloat16 else store

    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(p.to(storage(name)).float())

    out = os.path.join(out_root, fx["name"])
    os.makedirs(out, exist_ok=True)
    if fx["layout"] == "fused":
        # The official layout: module names, fused experts `mlp.experts.gate_up_proj [E, 2I, H]` and
        # `mlp.experts.down_proj [E, H, I]` without `.weight`, one file.
        model.config.save_pretrained(out)
        tensors = {k: v.to(storage(k)).contiguous() for k, v in model.state_dict().items()}
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    else:
        # What transformers 5.17's save_pretrained writes: per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`,
        # sharded with model.safetensors.index.json; then each shard re-written in the storage dtype.
        model.save_pretrained(out, safe_serialization=True, max_shard_size=fx["shard"])
        for f in sorted(os.listdir(out)):
            if f.endswith(".safetensors"):
                path = os.path.join(out, f)
                tensors = {k: v.to(storage(k)).contiguous() for k, v in load_file(path).items()}
                save_file(tensors, path, metadata={"format": "pt"})

    # Rewrite config.json dtype for the record.
    cfg_path = os.path.join(out, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["text_config"]["dtype"] = fx["dtype"]
    json.dump(cfg, open(cfg_path, "w"), indent=2)

    ids = torch.randint(0, text["vocab_size"], (fx["seq"],), generator=gen)
    full = prefill_logits(model, ids)
    split = split_logits(model, ids, fx["split"])
    save_file(
        {"ids": ids.float(), "logits": full.contiguous(), "logits_split": split.contiguous()},
        os.path.join(out, "expected.safetensors"),
    )

    # transformers' own bf16 run against its f32 run (the yardstick for the GPU's distance later).
    bf = Qwen3_5MoeForConditionalGeneration(config).eval()
    bf.load_state_dict(model.state_dict())
    bf = bf.to(torch.bfloat16)
    bf16_full = prefill_logits(bf, ids)
    bf16_split = split_logits(bf, ids, fx["split"])
    d_bf16 = rel_dist(bf16_full, full)
    d_bf16_split = rel_dist(bf16_split, split)
    d_split = rel_dist(split, full)
    meta = dict(
        split=fx["split"],
        seq=fx["seq"],
        storage_dtype=fx["dtype"],
        seed=seed,
        transformers=transformers.__version__,
        torch=torch.__version__,
        argmax_full=full.argmax(-1).tolist(),
        prefill_vs_split_max=max(d_split),
        bf16_vs_f32_prefill=dict(median=sorted(d_bf16)[len(d_bf16) // 2], max=max(d_bf16)),
        bf16_vs_f32_split=dict(median=sorted(d_bf16_split)[len(d_bf16_split) // 2], max=max(d_bf16_split)),
        bf16_argmax_agreement=float((bf16_full.argmax(-1) == full.argmax(-1)).float().mean()),
    )
    json.dump(meta, open(os.path.join(out, "meta.json"), "w"), indent=2)
    print(fx["name"], json.dumps({k: meta[k] for k in ("prefill_vs_split_max", "bf16_vs_f32_prefill")}))


def main():
    if transformers.__version__ != PINNED_TRANSFORMERS:
        print(f"warning: transformers {transformers.__version__}, fixtures were made with {PINNED_TRANSFORMERS}")
    try:
        import fla  # noqa: F401

        sys.exit("flash-linear-attention is installed: the reference must use transformers' torch fallbacks")
    except ImportError:
        pass
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    out_root = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures"
    for i, fx in enumerate(FIXTURES):
        make(fx, out_root, seed=1234 + i)


if __name__ == "__main__":
    main()

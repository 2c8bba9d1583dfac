#!/usr/bin/env python3
"""Write the vision fixtures: small synthetic images with what transformers' image processor for Qwen3.5/3.6-MoE
makes of them, and two tiny random vision-language checkpoints (`Qwen3_5MoeForConditionalGeneration` with a
`vision_config`) with what transformers computes for them: the vision tower's merged rows, and the logits of a
prompt with one and with two images (M-RoPE positions from transformers' own `get_rope_index`).

Usage (needs torch, transformers==5.17.0, Pillow, safetensors; CPU, a few seconds):

    python3 tools/make_vision_fixtures.py [OUT_DIR=tests/fixtures]

OUT_DIR/vision-images/ holds
    *.png / *.jpg            the inputs (one RGBA PNG, a JPEG saved 4:4:4)
    NAME.decoded.png         for the JPEG: PIL's decoded pixels (decoders differ by a few 8-bit levels)
    expected.json            per image: file, grid_thw, resized (h, w), tokens, rows kept (see below)
    pixels.safetensors       per image `NAME`: uint8 [rows kept, C * P * P]: the processor's pixel_values rows
                             mapped back to 8-bit before normalisation (round(255 * (v * std + mean))), first
                             temporal copy (the processor repeats each frame `temporal_patch_size` times; checked
                             here); the big image keeps every 7th row only (`stride` in expected.json)
The processor: transformers' `Qwen2VLImageProcessorPil` (what AutoImageProcessor gives `qwen3_5_moe` without
torchvision) with the model's patch 16, merge 2, temporal 2, mean = std = 0.5 and transformers' default pixel
budget (min 56*56, max 28*28*1280; the real checkpoint's preprocessor_config.json is not in ../shared).

OUT_DIR/tiny-vl-{a,b}/ hold config.json, model.safetensors and
    expected.safetensors   f32: pixel_values [N, C*T*P*P] and grid_thw [n, 3] of the two model images;
                           tower [tokens, out_hidden] (both images, in order); ids1 / logits1 (one image);
                           ids2 / logits2 (two images); positions1 / positions2 [3, T] (M-RoPE, t/h/w rows);
                           text_ids / text_logits (text only)
    meta.json
Everything is computed in float32 from the weights as stored (bf16 tensors rounded first), eager attention.
"""

import json
import math
import os
import sys

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402

import transformers  # noqa: E402
from safetensors.numpy import save_file as save_np  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

PATCH, MERGE, TEMPORAL = 16, 2, 2
MEAN = STD = [0.5, 0.5, 0.5]


def processor():
    return Qwen2VLImageProcessorPil(
        patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL, image_mean=MEAN, image_std=STD
    )


def pattern(h, w, rng, noise):
    """A smooth colour pattern with some noise (noise keeps the resampling honest, smoothness keeps files small)."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    r = 127.5 + 110 * np.sin(x / (w / 5.3) + 0.7) * np.cos(y / (h / 3.1))
    g = 127.5 + 110 * np.sin((x + y) / ((w + h) / 7.7))
    b = 127.5 + 110 * np.cos(x * y / (w * h / 9.0))
    img = np.stack([r, g, b], -1) + rng.uniform(-noise, noise, (h, w, 3))
    return np.clip(np.round(img), 0, 255).astype(np.uint8)


# name, (h, w), format, noise, row stride of the stored pixels
IMAGES = [
    ("exact", (64, 96), "png", 60.0, 1),  # no resize: a multiple of 32 within the budget
    ("alpha", (45, 70), "png", 30.0, 1),  # RGBA; upscaled to the minimum pixel budget
    ("wide", (100, 150), "jpg", 20.0, 1),  # JPEG (4:4:4), resized to a multiple of 32
    ("tall", (300, 20), "png", 20.0, 1),  # 15:1, upscaled
    ("big", (1000, 1280), "png", 40.0, 7),  # over the maximum pixel budget: downscaled; 20x20 blocks (small PNG)
]


def write_images(out_root):
    out = os.path.join(out_root, "vision-images")
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(1234)
    proc = processor()
    meta, tensors = [], {}
    for name, (h, w), fmt, noise, stride in IMAGES:
        if name == "big":
            arr = np.kron(pattern(h // 20, w // 20, rng, noise), np.ones((20, 20, 1), np.uint8))
        else:
            arr = pattern(h, w, rng, noise)
        if name == "alpha":
            alpha = np.clip(np.round(255 * rng.uniform(0, 1, (h, w))), 0, 255).astype(np.uint8)
            img = Image.fromarray(np.concatenate([arr, alpha[..., None]], -1), "RGBA")
        else:
            img = Image.fromarray(arr, "RGB")
        path = os.path.join(out, f"{name}.{fmt}")
        if fmt == "png":
            img.save(path, optimize=True)
        else:
            img.save(path, quality=92, subsampling=0)
        loaded = Image.open(path)
        if fmt == "jpg":
            # What PIL's decoder (libjpeg) makes of it, losslessly: resampling is then tested apart from decoding.
            Image.open(path).convert("RGB").save(os.path.join(out, f"{name}.decoded.png"), optimize=True)
        feats = proc(images=[loaded], return_tensors="np")
        pv, grid = feats["pixel_values"], feats["image_grid_thw"][0].tolist()
        c = 3
        rows = pv.reshape(pv.shape[0], c, TEMPORAL, PATCH * PATCH)
        assert np.array_equal(rows[:, :, 0], rows[:, :, 1]), "temporal copies differ"
        first = rows[:, :, 0].reshape(pv.shape[0], c * PATCH * PATCH)
        mean = np.repeat(np.array(MEAN), PATCH * PATCH)[None]
        std = np.repeat(np.array(STD), PATCH * PATCH)[None]
        u8 = (first.astype(np.float64) * std + mean) * 255.0
        assert np.abs(u8 - np.round(u8)).max() < 1e-3, "pixels are not 8-bit levels"
        u8 = np.round(u8).astype(np.uint8)[::stride]
        tensors[name] = np.ascontiguousarray(u8)
        tokens = grid[0] * grid[1] * grid[2] // (MERGE * MERGE)
        meta.append(
            dict(
                name=name,
                file=f"{name}.{fmt}",
                size=[h, w],
                grid_thw=grid,
                resized=[grid[1] * PATCH, grid[2] * PATCH],
                patches=int(pv.shape[0]),
                tokens=tokens,
                stride=stride,
            )
        )
        print(name, grid, tokens, os.path.getsize(path))
    save_np(tensors, os.path.join(out, "pixels.safetensors"))
    os.chmod(os.path.join(out, "pixels.safetensors"), 0o644)
    info = dict(
        processor="Qwen2VLImageProcessorPil",
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=TEMPORAL,
        image_mean=MEAN,
        image_std=STD,
        min_pixels=proc.size["shortest_edge"],
        max_pixels=proc.size["longest_edge"],
        transformers=transformers.__version__,
        images=meta,
    )
    json.dump(info, open(os.path.join(out, "expected.json"), "w"), indent=2)
    return out


TEXT = dict(
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    partial_rotary_factor=0.5,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    vocab_size=256,
)

MODELS = [
    dict(
        name="tiny-vl-a",  # f32; rotary 16 dims = 8 frequencies, mrope [3, 3, 2]; a 6x6 learned position grid
        dtype="float32",
        text=dict(
            TEXT,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000.0,
                partial_rotary_factor=0.5,
                mrope_interleaved=True,
                mrope_section=[3, 3, 2],
            ),
        ),
        vision=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            num_position_embeddings=36,
        ),
    ),
    dict(
        name="tiny-vl-b",  # bf16 storage; 4 heads of 16 in the tower, a 5x5 grid, mrope [4, 2, 2]
        dtype="bfloat16",
        text=dict(
            TEXT,
            hidden_size=96,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=1000000.0,
                partial_rotary_factor=0.5,
                mrope_interleaved=True,
                mrope_section=[4, 2, 2],
            ),
        ),
        vision=dict(
            depth=2,
            hidden_size=64,
            intermediate_size=96,
            num_heads=4,
            num_position_embeddings=25,
        ),
    ),
]

IMAGE_ID, START_ID, END_ID, VIDEO_ID = 250, 248, 249, 251


def randomise_vision(model, gen):
    for name, p in model.named_parameters():
        if not name.startswith("model.visual."):
            continue
        shape = p.shape
        if "norm" in name and name.endswith("weight"):
            v = torch.empty(shape).uniform_(0.5, 1.5, generator=gen)
        elif name.endswith("bias"):
            v = torch.empty(shape).uniform_(-0.2, 0.2, generator=gen)
        elif name.endswith("pos_embed.weight"):
            v = torch.randn(shape, generator=gen)
        elif name.endswith("patch_embed.proj.weight"):
            v = torch.randn(shape, generator=gen) / math.sqrt(shape[1:].numel())
        else:
            v = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        with torch.no_grad():
            p.copy_(v)


def prompt(gen, parts):
    """ids from parts: ints = that many random text ids, ('img', n) = vision_start, n pads, vision_end."""
    ids = []
    for p in parts:
        if isinstance(p, int):
            ids += torch.randint(0, 240, (p,), generator=gen).tolist()
        else:
            ids += [START_ID] + [IMAGE_ID] * p[1] + [END_ID]
    return torch.tensor(ids)


def make_model(fx, out_root, images_dir, seed):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    text = dict(fx["text"], rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    vision = dict(
        fx["vision"], patch_size=PATCH, temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE,
        out_hidden_size=text["hidden_size"],
    )
    config = Qwen3_5MoeConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_ID,
        video_token_id=VIDEO_ID,
        vision_start_token_id=START_ID,
        vision_end_token_id=END_ID,
    )
    config.text_config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    model = Qwen3_5MoeForConditionalGeneration(config).float().eval()
    model.config._attn_implementation = "eager"
    mf.randomise(model, gen)
    randomise_vision(model, gen)
    store = getattr(torch, fx["dtype"])

    def storage(name):
        keep_f32 = name.endswith("linear_attn.A_log") or name.endswith("linear_attn.norm.weight")
        return torch.float32 if keep_f32 and store == torch.bfloat16 else store

    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(p.to(storage(name)).float())

    out = os.path.join(out_root, fx["name"])
    os.makedirs(out, exist_ok=True)
    model.config.save_pretrained(out)
    tensors = {k: v.to(storage(k)).contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg_path = os.path.join(out, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["text_config"]["dtype"] = fx["dtype"]
    json.dump(cfg, open(cfg_path, "w"), indent=2)

    # The two model images: "exact" (64x96: grid 4x6, 6 tokens) and "wide" (160x96 after resize: 15 tokens).
    proc = processor()
    imgs = [Image.open(os.path.join(images_dir, f)) for f in ("exact.png", "wide.jpg")]
    feats = proc(images=imgs, return_tensors="pt")
    pv, grid = feats["pixel_values"].float(), feats["image_grid_thw"]
    ntok = (grid.prod(-1) // (MERGE * MERGE)).tolist()

    def run(ids, pixel_values, grid_thw):
        mm = (ids == IMAGE_ID).int()[None]
        with torch.no_grad():
            kw = {}
            if pixel_values is not None:
                kw = dict(pixel_values=pixel_values, image_grid_thw=grid_thw, mm_token_type_ids=mm)
            m = model.model
            pos = None
            if pixel_values is not None:
                pos, _ = m.get_rope_index(ids[None], mm_token_type_ids=mm, image_grid_thw=grid_thw)
                pos = pos[:, 0]
            m.rope_deltas = None
            logits = model(input_ids=ids[None], use_cache=False, **kw).logits[0].float()
            m.rope_deltas = None
        return logits, pos

    with torch.no_grad():
        tower = model.model.get_image_features(pv, grid).pooler_output
        tower = torch.cat(tower, 0).float()
    n0 = int(grid[0].prod()) // 1
    ids1 = prompt(gen, [5, ("img", ntok[1]), 7])
    logits1, pos1 = run(ids1, pv[n0:], grid[1:])
    ids2 = prompt(gen, [3, ("img", ntok[0]), 4, ("img", ntok[1]), 6])
    logits2, pos2 = run(ids2, pv, grid)
    text_ids = prompt(gen, [12])
    text_logits, _ = run(text_ids, None, None)

    save_file(
        {
            "pixel_values": pv.contiguous(),
            "grid_thw": grid.float(),
            "tower": tower.contiguous(),
            "ids1": ids1.float(),
            "logits1": logits1.contiguous(),
            "positions1": pos1.float().contiguous(),
            "ids2": ids2.float(),
            "logits2": logits2.contiguous(),
            "positions2": pos2.float().contiguous(),
            "text_ids": text_ids.float(),
            "text_logits": text_logits.contiguous(),
        },
        os.path.join(out, "expected.safetensors"),
    )
    meta = dict(
        storage_dtype=fx["dtype"],
        seed=seed,
        images=["vision-images/exact.png", "vision-images/wide.jpg"],
        tokens=ntok,
        transformers=transformers.__version__,
        torch=torch.__version__,
    )
    json.dump(meta, open(os.path.join(out, "meta.json"), "w"), indent=2)
    print(fx["name"], ntok, list(tower.shape), pos2[:, -1].tolist())


def main():
    if transformers.__version__ != mf.PINNED_TRANSFORMERS:
        print(f"warning: transformers {transformers.__version__}, fixtures were made with {mf.PINNED_TRANSFORMERS}")
    torch.set_num_threads(1)
    out_root = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures"
    images_dir = write_images(out_root)
    for i, fx in enumerate(MODELS):
        make_model(fx, out_root, images_dir, seed=9100 + i)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Write the multi-token-prediction (MTP) fixtures: tiny random Qwen3.5/3.6-MoE checkpoints that carry an
`mtp.*` block in the official names, and what an oracle built from Hugging Face transformers' own classes computes
for that block.

transformers ignores `mtp.*` (`_keys_to_ignore_on_load_unexpected = [r"^mtp.*"]`), so the oracle assembles the
block the way vLLM runs it (vllm/model_executor/models/qwen3_5_mtp.py, `Qwen3_5MultiTokenPredictor`):

    u = fc( cat([pre_fc_norm_embedding(embed_tokens(next_id)), pre_fc_norm_hidden(hidden)], -1) )   # embedding first
    u = one full-attention decoder layer with its sparse MoE, own KV cache     (positions: vLLM's, see below)
    d = mtp.norm(u)
    logits = lm_head(d)                                                          # shared embed_tokens and lm_head

with `hidden` the main model's last hidden state AFTER its final norm (vLLM's Qwen3NextModel.forward returns
`self.norm(hidden_states, residual)`, and that output is what the EAGLE/MTP proposer passes as
`target_hidden_states`). The decoder layer, the (1+w) RMSNorms, the rotary embedding, the causal mask and the KV
cache are transformers' own: the layer and `mtp.norm` are a one-layer `Qwen3_5MoeTextModel` whose only layer is a
`full_attention` `Qwen3_5MoeDecoderLayer`, fed through `inputs_embeds`. Positions follow vLLM's proposer: the MTP
row pairing the hidden state of position i with the token at i+1 sits at position i (draft steps continue at
i+1, i+2, ...).

Usage (needs torch, transformers==5.17.0, safetensors; CPU, a few seconds):

    python3 tools/make_mtp_fixtures.py [OUT_DIR=tests/fixtures]

For each fixture OUT_DIR/NAME/ holds:
    config.json (text_config.mtp_num_hidden_layers = 1), model*.safetensors[, model.safetensors.index.json]
    expected.safetensors   f32 tensors:
        ids               [T]        prompt ids (as f32)
        hidden            [T, H]     main model's post-final-norm hidden state, one prefill
        logits            [T, V]     main model's logits, one prefill
        mtp_logits        [T-1, V]   MTP rows (hidden[i], ids[i+1]) at positions 0..T-2, one call
        mtp_hidden        [T-1, H]   their post-mtp.norm hidden states
        mtp_logits_split  [T-1, V]   the same rows: the first `split` in one call, then one at a time via the cache
        chain_ids         [3]        a draft chain after them: argmax of logits[T-1], then the argmax of each step
        chain_logits      [3, V]     (hidden[T-1], chain_ids[0]) at T-1, then (MTP's own output, chain_ids[k]) at
                                     T-2+k+1 — the cache continuing from the split run
    meta.json              split, seq, versions
Everything is computed in float32 from the weights exactly as stored (bf16 tensors rounded first), eager attention.
"""

import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402  (its random scales, tiny vision config and pinned version)

import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import DynamicCache, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration  # noqa: E402
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig  # noqa: E402
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (  # noqa: E402
    Qwen3_5MoeRMSNorm,
    Qwen3_5MoeTextModel,
)

FIXTURES = [
    dict(
        name="tiny-mtp-a",  # f32 on disk, one file, fused experts (official layout), GDN then attention
        dtype="float32",
        layout="fused",
        seq=20,
        split=7,
        text=dict(
            hidden_size=64,
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
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
            vocab_size=256,
        ),
    ),
    dict(
        name="tiny-mtp-b",  # bf16 (A_log / gated norm f32), per-expert tensors sharded with an index, top-4 of 16,
        # 2 query heads per kv head, half the head rotating, split at 1
        dtype="bfloat16",
        layout="per-expert",
        shard="150KB",
        seq=24,
        split=1,
        text=dict(
            hidden_size=96,
            num_hidden_layers=2,
            layer_types=["full_attention", "linear_attention"],
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
            vocab_size=320,
        ),
    ),
]


class MtpOracle(nn.Module):
    """The MTP block from transformers' classes: fc and the two pre-fc (1+w) norms around a one-layer
    `Qwen3_5MoeTextModel` (its layer a full-attention `Qwen3_5MoeDecoderLayer`, its `norm` = `mtp.norm`)."""

    def __init__(self, mtp_config):
        super().__init__()
        h, eps = mtp_config.hidden_size, mtp_config.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5MoeRMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5MoeRMSNorm(h, eps=eps)
        self.block = Qwen3_5MoeTextModel(mtp_config)  # its embed_tokens is not used (the main model's is)

    def forward(self, embed, hidden, next_ids, positions, cache=None):
        e = self.pre_fc_norm_embedding(embed(next_ids))
        hh = self.pre_fc_norm_hidden(hidden)
        u = self.fc(torch.cat([e, hh], dim=-1))
        out = self.block(
            inputs_embeds=u[None],
            position_ids=positions[None],
            past_key_values=cache,
            use_cache=cache is not None,
        )
        return out.last_hidden_state[0]

    def official_state_dict(self):
        """The block's tensors under their official checkpoint names."""
        out = {}
        for k, v in self.state_dict().items():
            if k.startswith("block.embed_tokens") or "rotary_emb" in k:
                continue
            k = k.replace("block.layers.", "layers.").replace("block.norm.", "norm.")
            out["mtp." + k] = v
        return out


def per_expert(tensors):
    """Fused `mlp.experts.gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]` as per-expert `.weight` tensors."""
    out = {}
    for k, v in tensors.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            base, inter = k[: -len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = v[e, :inter].contiguous()
                out[f"{base}{e}.up_proj.weight"] = v[e, inter:].contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = v[e].contiguous()
        else:
            out[k] = v
    return out


def make(fx, out_root, seed):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    text = dict(fx["text"], rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    vision = dict(mf.TINY_VISION, out_hidden_size=text["hidden_size"])
    config = Qwen3_5MoeConfig(text_config=text, vision_config=vision)
    config.text_config._attn_implementation = "eager"
    model = Qwen3_5MoeForConditionalGeneration(config).float().eval()
    model.config._attn_implementation = "eager"
    mf.randomise(model, gen)

    mtp_text = dict(text, num_hidden_layers=1, layer_types=["full_attention"])
    mtp_config = Qwen3_5MoeTextConfig(**mtp_text)
    mtp_config._attn_implementation = "eager"
    mtp = MtpOracle(mtp_config).float().eval()
    mf.randomise(mtp, gen)

    store = getattr(torch, fx["dtype"])

    def storage(name):
        keep_f32 = name.endswith("linear_attn.A_log") or name.endswith("linear_attn.norm.weight")
        return torch.float32 if keep_f32 and store == torch.bfloat16 else store

    with torch.no_grad():
        for m in (model, mtp):
            for name, p in m.named_parameters():
                p.copy_(p.to(storage(name)).float())

    out = os.path.join(out_root, fx["name"])
    os.makedirs(out, exist_ok=True)
    mtp_tensors = {k: v.to(storage(k)).contiguous() for k, v in mtp.official_state_dict().items()}
    if fx["layout"] == "fused":
        model.config.save_pretrained(out)
        tensors = {k: v.to(storage(k)).contiguous() for k, v in model.state_dict().items()}
        tensors.update(mtp_tensors)
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    else:
        # transformers 5.17's save_pretrained (per-expert, sharded), each shard re-written in the storage dtype,
        # and the MTP block in one more shard of the index, per-expert too.
        model.save_pretrained(out, safe_serialization=True, max_shard_size=fx["shard"])
        for f in sorted(os.listdir(out)):
            if f.endswith(".safetensors"):
                path = os.path.join(out, f)
                tensors = {k: v.to(storage(k)).contiguous() for k, v in load_file(path).items()}
                save_file(tensors, path, metadata={"format": "pt"})
        shard = "model-mtp.safetensors"
        mtp_split = per_expert(mtp_tensors)
        save_file(mtp_split, os.path.join(out, shard), metadata={"format": "pt"})
        index_path = os.path.join(out, "model.safetensors.index.json")
        index = json.load(open(index_path))
        index["weight_map"].update({k: shard for k in mtp_split})
        json.dump(index, open(index_path, "w"), indent=2)

    cfg_path = os.path.join(out, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["text_config"]["dtype"] = fx["dtype"]
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    cfg["text_config"]["mtp_use_dedicated_embeddings"] = False
    json.dump(cfg, open(cfg_path, "w"), indent=2)

    T = fx["seq"]
    ids = torch.randint(0, text["vocab_size"], (T,), generator=gen)
    lm = model.model.language_model
    embed, head = lm.embed_tokens, model.lm_head
    with torch.no_grad():
        hidden = lm(input_ids=ids[None], use_cache=False).last_hidden_state[0].float()
        logits = head(hidden)
        whole = model(input_ids=ids[None], use_cache=False).logits[0].float()
        assert torch.equal(logits, whole), "lm_head(last_hidden_state) must be the model's logits"

        pos = torch.arange(T - 1)
        mtp_hidden = mtp(embed, hidden[:-1], ids[1:], pos)
        mtp_logits = head(mtp_hidden)

        split = fx["split"]
        cache = DynamicCache(config=mtp_config)
        rows = [head(mtp(embed, hidden[:split], ids[1 : split + 1], pos[:split], cache))]
        for i in range(split, T - 1):
            rows.append(head(mtp(embed, hidden[i : i + 1], ids[i + 1 : i + 2], pos[i : i + 1], cache)))
        mtp_split = torch.cat(rows, 0)

        # A draft chain continuing the cache: the next token from the main model, then the MTP's own.
        chain_ids, chain_logits = [int(logits[T - 1].argmax())], []
        h = hidden[T - 1 : T]
        for k in range(3):
            d = mtp(embed, h, torch.tensor(chain_ids[k : k + 1]), torch.tensor([T - 1 + k]), cache)
            lg = head(d)
            chain_logits.append(lg)
            if k < 2:
                chain_ids.append(int(lg[0].argmax()))
            h = d
        chain_logits = torch.cat(chain_logits, 0)

    save_file(
        {
            "ids": ids.float(),
            "hidden": hidden.contiguous(),
            "logits": logits.contiguous(),
            "mtp_logits": mtp_logits.contiguous(),
            "mtp_hidden": mtp_hidden.contiguous(),
            "mtp_logits_split": mtp_split.contiguous(),
            "chain_ids": torch.tensor(chain_ids, dtype=torch.float32),
            "chain_logits": chain_logits.contiguous(),
        },
        os.path.join(out, "expected.safetensors"),
    )
    d_split = mf.rel_dist(mtp_split, mtp_logits)
    meta = dict(
        split=split,
        seq=T,
        storage_dtype=fx["dtype"],
        seed=seed,
        transformers=transformers.__version__,
        torch=torch.__version__,
        chain_ids=chain_ids,
        mtp_prefill_vs_split_max=max(d_split),
        mtp_argmax=mtp_logits.argmax(-1).tolist(),
    )
    json.dump(meta, open(os.path.join(out, "meta.json"), "w"), indent=2)
    print(fx["name"], json.dumps({k: meta[k] for k in ("chain_ids", "mtp_prefill_vs_split_max")}))


def main():
    if transformers.__version__ != mf.PINNED_TRANSFORMERS:
        print(f"warning: transformers {transformers.__version__}, fixtures were made with {mf.PINNED_TRANSFORMERS}")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    out_root = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures"
    for i, fx in enumerate(FIXTURES):
        make(fx, out_root, seed=4321 + i)


if __name__ == "__main__":
    main()

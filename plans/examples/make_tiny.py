"""Write the bundled tiny Qwen3-MoE checkpoint (real random weights) that `plan apply` runs on.

    python plans/examples/make_tiny.py

The checkpoint is committed (about 1 MB), because random weights differ
across torch versions and the committed plan records its fingerprint; run
this only to change the model, then rebuild `tiny-moe.plan.yaml`.
Needs torch and transformers.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

OUT = Path(__file__).resolve().parent / "tiny-moe"


def main() -> None:
    config = Qwen3MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=256, decoder_sparse_step=1,
        mlp_only_layers=[], tie_word_embeddings=False,
        offplan_random_weights=True)  # in config.json: `plan apply` says the weights are random
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    shutil.rmtree(OUT, ignore_errors=True)
    model.save_pretrained(OUT, max_shard_size="300KB")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

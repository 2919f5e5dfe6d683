"""Tiny real transformers checkpoints (random weights), saved as sharded safetensors, for runtime tests."""
from __future__ import annotations

from pathlib import Path

import torch

from planner.build import build
from planner.files import write_atomic
from planner.planfile import dumps
from planner.policy import load_policy


def llama_config(**overrides):
    from transformers import LlamaConfig
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              tie_word_embeddings=False)
    kw.update(overrides)
    return LlamaConfig(**kw)


def qwen3_moe_config(**overrides):
    from transformers import Qwen3MoeConfig
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
              decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def save_model(config, directory: Path, seed: int = 0, shard: str = "40KB") -> Path:
    """A randomly initialised model saved with save_pretrained as several shards."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # norms start at 1.0: randomise them so a misplaced one shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory, max_shard_size=shard)
    return directory


def save_models(root: Path, *kinds: str) -> dict[str, Path]:
    """The shared tiny checkpoints: llama (dense), moe (Qwen3-MoE), tied (tied embeddings),
    small (tensors of 1 MiB and more, for memory accounting)."""
    made = {
        "llama": lambda: save_model(llama_config(), root / "llama"),
        "moe": lambda: save_model(qwen3_moe_config(), root / "moe"),
        "tied": lambda: save_model(llama_config(tie_word_embeddings=True, num_hidden_layers=3), root / "tied"),
        "small": lambda: save_model(llama_config(hidden_size=1024, intermediate_size=3072, vocab_size=8192,
                                                 num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4),
                                    root / "small", shard="40MB"),
    }
    return {k: made[k]() for k in kinds}


def reference(directory: Path, device="cpu"):
    """The same checkpoint loaded plainly by transformers."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).to(device).eval()


def make_plan(tmp: Path, checkpoint: Path, body: str, name: str = "p") -> Path:
    """Write a policy next to `tmp` and build its plan file; returns the plan path."""
    policy = tmp / f"{name}.policy.yaml"
    policy.write_text(f"format_version: 1\ncheckpoint: {checkpoint}\n{body}\n")
    out = tmp / f"{name}.plan.yaml"
    write_atomic(out, dumps(build(load_policy(policy), tmp)))
    return out


def logits(model, device="cpu", seed: int = 1):
    torch.manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 9)).to(device)
    with torch.no_grad():
        return model(ids).logits

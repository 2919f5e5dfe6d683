"""Tiny real transformers checkpoints (random weights), saved as sharded safetensors, for runtime tests."""
from __future__ import annotations

from pathlib import Path

import torch

from planner.decide.build import build
from planner.files import write_atomic
from planner.inputs.policy import load_policy
from planner.planfile import dumps


# Experts on cpu (tests/execute/test_host_experts.py, host/test_fp8_experts.py and their GPU tests): experts 0 and 1
# of every layer on cpu, 2 on uva, 3 on the GPU.
HOST_SPLIT = "rules:\n  - {match: ['re:experts\\.[01]\\.'], place: cpu}\n  - {match: ['re:experts\\.2\\.'], place: uva}\n"
# A bf16 GEMV summed in another order rounds to the same bf16 value, or one unit in the last place (2^-8
# relative) off. Through three layers that moves the logits (bf16, up to about 5.6 here, where a unit is 2^-5) by a
# few of their own units: on CUDA, against cuBLAS's sums, up to 0.078 (2.5 units) over 12 steps of two sequences on
# the H200 machine (docs/host-experts/lockstep.py); on the 2-CPU VM the CPU's agreed bitwise in that script's run,
# which other CPUs need not. The tolerance is 4 units.
HOST_TOLERANCE = dict(rtol=0, atol=0.125)
# Weights drawn with std 0.2, so that the experts weigh in the logits: the logits spread by 1.6, and a host that
# computes nothing moves them by about 2.
HOST_LOUD = dict(initializer_range=0.2)


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


def save_model(config, directory: Path, seed: int = 0, shard: str = "40KB", dtype=torch.bfloat16) -> Path:
    """A randomly initialised model saved with save_pretrained as several shards."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
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


def reference(directory: Path, device="cpu", dtype=torch.bfloat16):
    """The same checkpoint loaded plainly by transformers."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()


def transformers_greedy(directory, prompts: list[list[int]], new: int, like, pad: int = 0,
                        device: str = "cpu") -> list[list[int]]:
    """transformers' `generate` on the plain model: left-padded prompts, their attention mask, a static cache of
    the generator's length (attention over another length rounds otherwise, and a router's top-k can flip). An MoE model
    runs the experts implementation of `like` (offplan's, where it holds experts in pinned memory: transformers'
    `batched_mm` and `grouped_mm` arithmetic by the pairs of each forward, runtime/execute/experts.py)."""
    from transformers import StaticCache

    from runtime.execute.generation import CACHE_QUANTUM
    model = reference(directory, device)
    if hasattr(like.config, "num_experts"):
        model.set_experts_implementation(like.config._experts_implementation)
    length = max(map(len, prompts))
    ids = torch.tensor([[pad] * (length - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts], device=device)
    cache = StaticCache(config=model.config, max_cache_len=CACHE_QUANTUM)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=pad, past_key_values=cache)
    return out[:, length:].tolist()


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


# Tiny configs of the families offplan is tested on (tests/place/test_families.py): a few layers of 64 wide, each
# family's own structure kept (what offloading meets: fused experts, dense first layers, shared experts, tied
# embeddings, buffers computed at load, a vision tower). Token ids >= 250 are the VLMs' special tokens.

def mixtral_config(**overrides):
    from transformers import MixtralConfig
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
              max_position_embeddings=128, tie_word_embeddings=False)
    kw.update(overrides)
    return MixtralConfig(**kw)


def deepseek_v3_config(**overrides):
    """MLA (q and kv LoRA ranks; a query head is nope 16 + rope 8 wide, `head_dim` is the rope part as the
    config class derives it, values 16), a dense first layer, then MoE layers of 4 routed experts in 2 groups
    plus a shared expert; YaRN rope as the real config, scaled to 128 positions."""
    from transformers import DeepseekV3Config
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=1, n_shared_experts=1,
              n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=32,
              qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8, v_head_dim=16, max_position_embeddings=128,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
                               "mscale": 1.0, "mscale_all_dim": 1.0},
              tie_word_embeddings=False)
    kw.update(overrides)
    return DeepseekV3Config(**kw)


def glm4_moe_config(**overrides):
    """GLM-4.5's structure: q, k and v biases, q/k norms, half the head rotated, a dense first layer, then routed
    experts (sigmoid scores with a correction bias, as DeepSeek-V3) and a shared expert."""
    from transformers import Glm4MoeConfig
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, first_k_dense_replace=1, n_shared_experts=1,
              n_routed_experts=4, num_experts_per_tok=2, attention_bias=True, use_qk_norm=True,
              partial_rotary_factor=0.5, max_position_embeddings=128, tie_word_embeddings=False)
    kw.update(overrides)
    return Glm4MoeConfig(**kw)


def qwen3_next_config(**overrides):
    """Qwen3-Next's structure: linear attention (gated delta rule, a causal conv) in three layers of four, gated full
    attention in the fourth with a quarter of the head rotated, every layer's routed experts beside a gated shared
    expert."""
    from transformers import Qwen3NextConfig
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
              shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
              tie_word_embeddings=False)
    kw.update(overrides)
    return Qwen3NextConfig(**kw)


def gpt_oss_config(**overrides):
    """Alternating sliding-window and full attention (window 8: the test prompts pass it), attention sinks,
    4 experts with biases fused as [E, H, 2I], YaRN rope scaled to 128 positions; saved in bf16 (not MXFP4)."""
    from transformers import GptOssConfig
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
              max_position_embeddings=128, tie_word_embeddings=False,
              rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32})
    kw.update(overrides)
    return GptOssConfig(**kw)


def llama4_text_config(**overrides):
    """MoE every second layer (1 routed expert of 4 plus a shared one), dense MLPs between, chunked attention."""
    from transformers import Llama4TextConfig
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=32, intermediate_size_mlp=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
              interleave_moe_layer_step=2, attention_chunk_size=8, max_position_embeddings=128,
              tie_word_embeddings=False)
    kw.update(overrides)
    return Llama4TextConfig(**kw)


def gemma2_config(**overrides):
    """Tied embeddings scaled by a computed buffer, sliding-window layers, logit soft-capping."""
    from transformers import Gemma2Config
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, sliding_window=8, max_position_embeddings=128)
    kw.update(overrides)
    return Gemma2Config(**kw)


def gemma3_text_config(**overrides):
    """As Gemma 2, with QK norms and a rotary table per attention type (both computed buffers)."""
    from transformers import Gemma3TextConfig
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, sliding_window=8, max_position_embeddings=128)
    kw.update(overrides)
    return Gemma3TextConfig(**kw)


def qwen2_vl_config(**overrides):
    """A 2-block ViT on 4x4 patches (2 frames), merged 2x2 into the text stack's width; M-RoPE over 3 axes."""
    from transformers import Qwen2VLConfig
    kw = dict(text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                               bos_token_id=0, eos_token_id=1,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "mrope_section": [2, 2, 4]}),
              vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=4,
                                 spatial_merge_size=2, temporal_patch_size=2),
              image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253,
              tie_word_embeddings=False)
    kw.update(overrides)
    return Qwen2VLConfig(**kw)


def llava_config(**overrides):
    """A 2-layer CLIP tower on 16x16 images (16 patches of 4x4, each an image token), the last layer's
    features, a 2-layer projector, a Llama text stack."""
    from transformers import LlavaConfig
    kw = dict(vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=4),
              text_config=dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=128, bos_token_id=0, eos_token_id=1),
              image_token_index=250, vision_feature_layer=-1, tie_word_embeddings=False)
    kw.update(overrides)
    return LlavaConfig(**kw)


def auto_class(config):
    """The Auto class that builds `config`'s model: image-text-to-text for a VLM, else causal LM."""
    import transformers
    if type(config) in transformers.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def save_family(config, directory: Path, seed: int = 0, shard: str = "40KB", dtype=torch.bfloat16) -> Path:
    """As save_model, for any family: its own model class; 1-dim persistent buffers (DeepSeek-V3's router
    correction bias) are randomised too, so that a misplaced one shows."""
    torch.manual_seed(seed)
    model = auto_class(config).from_config(config, dtype=dtype)
    state = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, t in state.items():
            if t.dim() == 1 and t.is_floating_point():
                t.add_(torch.randn_like(t) * 0.1)
    model.save_pretrained(directory, max_shard_size=shard)
    return directory


def reference_family(directory: Path):
    """The checkpoint loaded plainly by transformers, through the class its config.json names."""
    import transformers
    config = transformers.AutoConfig.from_pretrained(directory)
    cls = getattr(transformers, config.architectures[0])
    return cls.from_pretrained(directory, dtype=torch.bfloat16).eval()


def check_ring(handle) -> list[int]:
    """Wrap the prefill stager's expert fill (runtime/execute/ring.py) so that after each fill the experts forward's
    rows are compared with the module's own fused parameters, every row: those gathered from HBM and those the ring
    delivered (on CUDA a row the ring missed would hold whatever memory the allocator handed back, possibly the
    right values from a previous forward). Returns the units filled, in order."""
    from runtime.execute.experts import fused_params
    stager, filled = handle.prefill, []
    fill = stager.fill

    def checked(unit, rows):
        fill(unit, rows)
        module = stager.ring_modules[unit]
        for name, got in zip(fused_params(module), rows):
            assert torch.equal(got, getattr(module, name).detach().to(got.device)), f"unit {unit}: {name} differs"
        filled.append(unit)

    stager.fill = checked
    return filled

"""What the planner reads from a checkpoint's config.json: the facts that names alone do not give.

- `top_k`: experts per token, for the cost model (the policy's
  `workload.experts_per_token` overrides it);
- `layers`: the text model's decoder layers (`num_hidden_layers`); a layer of
  the main stack numbered past them is a multi-token-prediction (MTP) layer
  when `mtp_layers` (`num_nextn_predict_layers`: DeepSeek-V3, GLM-4.5) says
  there are some: it never runs in plain decode;
- `vision`: the model has a vision tower (`vision_config`);
- `experts`: routed experts per MoE layer (`num_local_experts`, `num_experts`,
  `n_routed_experts`), which the first dimension of experts stored already
  fused must match (prefused.py);
- `fp8_block`: the rows and columns each FP8 scale covers
  (`quantization_config.weight_block_size`, default 128 x 128, as the runtime
  reads it), which an FP8 weight's scales must count (quantized.py);
- for tensor parallelism (layers/shards.py): `model_type`, which says whose
  sharding plan applies, the attention heads and key/value heads each GPU must
  take a whole share of, `hidden` (the activations a collective sums:
  `hidden_size`) and whether the head is tied to the embedding
  (`tie_word_embeddings`).

A vision-language model nests the text facts under `text_config`, which wins.
A missing config.json gives no facts (names still decide); one that cannot be
read or parsed is an error (`read_config`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError

_TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k", "moe_k")
_EXPERTS_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_COUNTS = ("num_experts_per_tok", *_EXPERTS_KEYS)  # text in one of these is an error (`read_config`)
FP8_BLOCK = (128, 128)  # runtime/place/quant.py's default too


@dataclass(frozen=True)
class ModelFacts:
    top_k: int | None = None
    layers: int | None = None
    mtp_layers: int = 0
    vision: bool = False
    experts: int | None = None
    fp8_block: tuple[int, int] = FP8_BLOCK
    model_type: str | None = None
    heads: int | None = None  # num_attention_heads
    kv_heads: int | None = None  # num_key_value_heads (default: heads)
    hidden: int | None = None  # hidden_size
    tied: bool = False  # tie_word_embeddings


def _int(scope: dict, *keys: str) -> int | None:
    for key in keys:
        value = scope.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def read_config(checkpoint_root: str | Path) -> ModelFacts:
    """The facts of the checkpoint's config.json (module doc); empty facts without one. One that is there but
    unreadable, not a JSON object, or whose experts-per-token or experts count is text, is an error: planned
    without it, the plan would assume every expert is read, and only the load would say why."""
    path = Path(checkpoint_root) / "config.json"
    fix = "restore the checkpoint's config.json (transformers needs it to load the model too)"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return ModelFacts()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror}: {fix}") from None
    except ValueError as e:  # JSON, or bytes that are not UTF-8
        raise CheckpointError(f"{path}: not valid JSON ({e}): {fix}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: a JSON {type(config).__name__}, not an object of the model's settings: {fix}")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    odd = [f"{key}: {s[key]!r}" for s in (text, config) for key in _COUNTS if isinstance(s.get(key), str)]
    if odd:
        raise CheckpointError(f"{path}: {', '.join(odd)}: a whole number was expected: {fix}")
    scopes = (text, config)  # the text model's facts first
    return ModelFacts(
        top_k=next((v for s in scopes if (v := _int(s, *_TOP_K_KEYS))), None),
        layers=next((v for s in scopes if (v := _int(s, "num_hidden_layers"))), None),
        mtp_layers=next((v for s in scopes if (v := _int(s, "num_nextn_predict_layers"))), 0),
        vision=isinstance(config.get("vision_config"), dict),
        experts=next((v for s in scopes if (v := _int(s, *_EXPERTS_KEYS))), None),
        fp8_block=_block(config.get("quantization_config")),
        model_type=next((v for s in scopes if isinstance(v := s.get("model_type"), str)), None),
        heads=(heads := next((v for s in scopes if (v := _int(s, "num_attention_heads"))), None)),
        kv_heads=next((v for s in scopes if (v := _int(s, "num_key_value_heads"))), heads),
        hidden=next((v for s in scopes if (v := _int(s, "hidden_size"))), None),
        tied=next((v for s in scopes if isinstance(v := s.get("tie_word_embeddings"), bool)), False))


def _block(quantization) -> tuple[int, int]:
    """`weight_block_size` as two positive whole numbers (as the runtime reads it: `[128.0, 128]` is 128 x
    128), else the default."""
    block = quantization.get("weight_block_size") if isinstance(quantization, dict) else None
    if (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 1 <= b < 2**31 and b == int(b)
                    for b in block)):
        return int(block[0]), int(block[1])
    return FP8_BLOCK

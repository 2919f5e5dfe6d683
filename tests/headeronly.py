"""Shared test helpers: hand-written safetensors files, toy models and policies as plain data.

Sizes are in MiB (U8 tensors of shape (n * MiB,)) so that budgets in GiB are
exact binary fractions: `budget_gib=mib(10)` is exactly 10 MiB.
"""
from __future__ import annotations

import json
from pathlib import Path

from planner.decide.placement import decide
from planner.inputs.checkpoint import TensorInfo
from planner.inputs.dtypes import nbytes
from planner.inputs.patterns import compile_pattern
from planner.inputs.policy import Policy, PrefetchPolicy, Rule, UvaPolicy
from planner.inputs.routing import HEADER
from planner.layers.graph import build_graph
from planner.plan import Backend, Placement

MiB = 2**20
GPU, UVA, PREFETCH = Placement.GPU, Placement.UVA, Placement.PREFETCH


def mib(n: float) -> float:
    """n MiB expressed in GiB, for `budget_gib` / `offload_gib`."""
    return n / 1024


def write_raw_shard(path: Path, header: dict, data_len: int, header_len: int | None = None) -> Path:
    """A safetensors file with exactly this header JSON and `data_len` zero bytes of data.

    `header_len` overrides the 8-byte length prefix (to write a corrupt file).
    """
    raw = json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    with open(path, "wb") as f:
        f.write(n.to_bytes(8, "little"))
        f.write(raw)
        f.truncate(8 + len(raw) + data_len)
    return path


def entries(*tensors: tuple[str, str, tuple[int, ...]]) -> tuple[dict, int]:
    """Contiguous header entries for (name, dtype, shape) triples: (header dict, data length)."""
    header, offset = {}, 0
    for name, dtype, shape in tensors:
        size = nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    return header, offset


def write_index(directory: Path, weight_map: dict[str, str]) -> Path:
    path = directory / "model.safetensors.index.json"
    path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def toy(layers: int = 4, sizes: dict[str, int] | None = None, stack: str = "model.layers",
        tied: bool = False) -> list[tuple[str, str, tuple[int, ...]]]:
    """A decoder with `layers` layers; each param of `sizes` (local name -> MiB) is a U8 tensor.

    Embedding 4 MiB, final norm 1 MiB, head 4 MiB (unless tied).
    """
    sizes = sizes or {"self_attn.o_proj.weight": 1, "mlp.down_proj.weight": 2}
    out = [("model.embed_tokens.weight", "U8", (4 * MiB,))]
    for i in range(layers):
        out += [(f"{stack}.{i}.{local}", "U8", (n * MiB,)) for local, n in sizes.items()]
    out.append(("model.norm.weight", "U8", (1 * MiB,)))
    if not tied:
        out.append(("lm_head.weight", "U8", (4 * MiB,)))
    return out


def moe_toy(layers: int = 3, experts: int = 2) -> list:
    """Per layer: attention 1 MiB, then experts e: down/gate/up 1 MiB each (a fused group)."""
    out = [("model.embed_tokens.weight", "BF16", (512, 1024))]
    for i in range(layers):
        out.append((f"model.layers.{i}.self_attn.o_proj.weight", "BF16", (512, 1024)))
        for e in range(experts):
            for proj in ("down_proj", "gate_proj", "up_proj"):
                out.append((f"model.layers.{i}.mlp.experts.{e}.{proj}.weight", "BF16", (512, 1024)))
    out.append(("lm_head.weight", "BF16", (512, 1024)))
    return out


def experts_of(*layers: int, experts: int = 2) -> list[str]:
    return [f"model.layers.{i}.mlp.experts.{e}.{p}.weight" for i in layers for e in range(experts)
            for p in ("down_proj", "gate_proj", "up_proj")]


def infos(tensors) -> dict[str, TensorInfo]:
    """TensorInfo records for (name, dtype, shape) triples, as open_checkpoint would give."""
    return {n: TensorInfo(n, d, tuple(s), nbytes(d, tuple(s)), "model.safetensors", 0)
            for n, d, s in tensors}


# A Qwen3-MoE small enough to split by hand over 2 GPUs (tensor parallelism): 4 heads of 16, 2 key/value heads,
# 4 experts of 32; per GPU a layer holds 37,696 of its 74,560 bytes, the checkpoint 100,096 of 182,016.
TP_MOE = dict(layers=2, hidden=64, experts=4, moe_intermediate=32, heads=4, kv_heads=2, head_dim=16, vocab=128)


def tp_checkpoint(directory: Path, **config) -> Path:
    """TP_MOE as a header-only checkpoint at `directory`, with the config.json a tensor-parallel plan reads
    (model type, heads, hidden size; 2 experts per token); `config` overrides its keys."""
    from synthetic import qwen3_moe, write_header_only
    write_header_only(directory, qwen3_moe(**TP_MOE), single=True)
    (directory / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_experts_per_tok": 2, **config}))
    return directory


def policy(backend: str = "auto", budget_gib: float | None = None, offload_gib: float = 0,
           uva_params=(), group_size: int = 0, num_in_group: int = 1, step: int = 1,
           prefetch_params=(), rules=(), stacks=None, stage_prefill: bool = True,
           stage_experts: bool | None = None) -> Policy:
    """A Policy built directly (no YAML): rules are (patterns, place) pairs."""
    pats = lambda items: tuple(compile_pattern(p) for p in items)  # noqa: E731
    return Policy(
        path=Path("test.policy.yaml"), fingerprint="sha256:" + "0" * 64,
        checkpoint=Path("ckpt"), checkpoint_text="ckpt", backend=Backend(backend),
        budget_gib=budget_gib, stacks=None if stacks is None else tuple(stacks),
        uva=UvaPolicy(offload_gib, pats(uva_params), stage_prefill, stage_experts),
        prefetch=PrefetchPolicy(group_size, num_in_group, step, pats(prefetch_params)),
        rules=tuple(Rule(pats(m), Placement(p)) for m, p in rules))


def plan_of(tensors, pol: Policy):
    """Run the pure planner on plain data: (decision, tensor infos)."""
    t = infos(tensors)
    return decide(build_graph(t, pol.stacks), t, pol), t


def placed(decision, kind: Placement) -> list[str]:
    return [n for n, p in decision.params.items() if p is kind]


def offloaded_layers(decision, kind: Placement = PREFETCH) -> list[int]:
    """Indices of the stack layers holding any tensor placed `kind`."""
    return [int(l.name.rsplit(".", 1)[1]) for l in decision.layers
            if getattr(l, kind.value) and l.name.rsplit(".", 1)[1].isdigit()]


POLICY_HEAD = "format_version: 1\ncheckpoint: ./ckpt\n"


def write_policy(directory: Path, body: str = "", name: str = "model.policy.yaml",
                 head: str = POLICY_HEAD) -> Path:
    path = directory / name
    path.write_text(head + body)
    return path


# A routing profile of a two-layer, 8-expert model (format 1), skewed per layer.
FP = "sha256:" + "ab" * 32

PROFILE = """\
format_version: 1
checkpoint:
  path: ckpt
  fingerprint: "{fp}"
recorded:
  prompts: prompts.txt
  sequences: 4
  new_tokens: 26
  top_k: 2
tokens:
  prefill: 40
  decode: 100
layers:
  model.layers.0.mlp.experts:
    experts: 8
    decode: [60, 0, 50, 0, 0, 45, 0, 45]
    prefill: [10, 10, 10, 10, 10, 10, 10, 10]
  model.layers.1.mlp.experts:
    experts: 8
    decode: [0, 70, 0, 50, 40, 0, 40, 0]
    prefill: [20, 0, 20, 0, 20, 0, 20, 0]
"""


def profile_file(tmp_path, text=None, fp=FP, name="r.routing.yaml"):
    path = tmp_path / name
    path.write_text(HEADER + (text or PROFILE).format(fp=fp))
    return path

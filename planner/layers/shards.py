"""Tensor parallelism: which checkpoint tensors each GPU holds a share of, along which dimension, and which
module outputs the GPUs then sum or gather.

Why: a host's GPUs each have their own PCIe link. If every GPU holds its
share of every layer, a decode step reads each offloaded tensor over all the
links at once, and the links add up (55 GB/s each for copies, 50 for UVA
reads, measured together on two GPUs: 49 and 50.5 each). Splitting whole
layers between GPUs instead (a pipeline, not built) streams only what all the
GPUs' memory together leaves out, one stage at a time: at batch 1 about 1/G
of tensor parallelism's speed with equal budgets (docs/pipeline/README.md).

What splits is transformers' own tensor-parallel plan (`base_model_tp_plan`
of the config class, `_tp_plan` of the model) for the model types listed in
`TP_PLANS`, restated here on checkpoint names because the planner reads
headers only and imports no transformers; the runtime checks every split
against transformers' plan for the model it loads (runtime/place/shards.py):

- colwise, split along dim 0 (output features): attention's q, k, v
  projections (weights and biases), the MLP's gate and up projections, each
  routed expert's gate and up (`w1`, `w3`); transformers fuses a layer's
  experts into `gate_up_proj` [E, 2I, H] and splits it `packed_colwise`:
  each GPU holds its share of gate and of up, which is exactly the fusion of
  the split per-expert tensors;
- rowwise, split along dim 1 (input features): attention's o projection, the
  MLP's down projection, each expert's down (`w2`) and the shared experts'
  (deepseek_v3's and glm4_moe's; their gate and up colwise). Such a module computes a
  partial sum: its output is summed over the GPUs (an all-reduce): `reduce`
  lists those modules, an experts module once for all its experts;
- the head (`lm_head`, `colwise_gather_output`): split along dim 0 (the
  vocabulary), its output gathered (`gather`). Not when tied to the embedding,
  which is not split: then it stays whole on every GPU.
Everything else (embeddings, norms, routers) is whole on every GPU, and
deepseek_v3's attention too (MLA: transformers' plan splits none of its
projections; DeepSeek-V3's weights are nearly all experts). The
plan is keyed by checkpoint names; `split` names them by template, numbers
replaced by `*` (`model.layers.*.mlp.experts.*.down_proj.weight`), as
transformers' plans do.

Where attention splits, each GPU must take whole attention heads and whole
key/value heads (config.json's `num_attention_heads`, `num_key_value_heads`),
and every split dimension must divide by the GPU count.

Block-scaled FP8 (`X.weight` F8 with `X.weight_scale_inv`, one scale per
b0 x b1 block, config.json's `weight_block_size`): the scales split with their
weight, along the same dim, so each GPU holds whole blocks and their scales,
and dequantizes its share as one GPU dequantizes the whole. So a split dim
must divide by the GPU count times the block (vLLM refuses the same: Qwen3-
30B-A3B-FP8's experts, 768 rows in blocks of 128, split over 2 GPUs but not 4).

Not supported (an error names the tensor): a rowwise projection with a bias
(it would be added once per GPU), experts stored already fused (gpt-oss: their
gate and up interleave), MXFP4 (stored only by gpt-oss, whose experts are
fused), and a checkpoint none of whose names the plan splits (every GPU would
hold it all).

`local_tensors` is one GPU's view of the checkpoint: every split tensor with
its share's shape and bytes. The placement, the footprint, the slot layouts
and the cost model all work on it unchanged, so a plan for N GPUs is one
plan that every GPU applies to its own share.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..inputs.checkpoint import TensorInfo
from ..inputs.config import ModelFacts
from ..inputs.prefused import prefused_key
from ..inputs.quantized import FP8, FP8_SCALE, MX_BLOCKS, MX_SCALES

# model_type -> transformers' tensor-parallel plan, as the checkpoint names it: (pattern, dim, what sums it)
# The patterns are searched in each name; `reduce` is the module whose output is summed ("" : none, the
# tensor is colwise), `\1` the name up to the module.
_ATTENTION = ((r"^(.*\.self_attn\.[qkv]_proj)\.(weight|bias)$", 0, ""),
              (r"^(.*\.self_attn\.o_proj)\.weight$", 1, r"\1"))
_MLP = ((r"^(.*\.mlp\.(gate|up)_proj)\.(weight|bias)$", 0, ""),  # a colwise bias splits with its weight
        (r"^(.*\.mlp\.down_proj)\.weight$", 1, r"\1"))
_EXPERTS = ((r"^(.*\.experts)\.\d+\.(gate_proj|up_proj|w1|w3)\.(weight|bias)$", 0, ""),
            (r"^(.*\.experts)\.\d+\.(down_proj|w2)\.weight$", 1, r"\1"))
_SHARED = ((r"^(.*\.shared_experts\.(gate|up)_proj)\.weight$", 0, ""),
           (r"^(.*\.shared_experts\.down_proj)\.weight$", 1, r"\1"))
TP_PLANS = {"llama": _ATTENTION + _MLP, "mistral": _ATTENTION + _MLP, "qwen2": _ATTENTION + _MLP,
            "qwen3": _ATTENTION + _MLP, "qwen3_moe": _ATTENTION + _MLP + _EXPERTS,
            "mixtral": _ATTENTION + _EXPERTS, "deepseek_v3": _MLP + _SHARED + _EXPERTS,
            "glm4_moe": _ATTENTION + _MLP + _SHARED + _EXPERTS}
_HEADS = {k for k, v in TP_PLANS.items() if _ATTENTION[0] in v}  # plans that split attention by heads
HEAD = "lm_head"
_COMPILED = {k: tuple((re.compile(p), d, r) for p, d, r in v) for k, v in TP_PLANS.items()}
_BIAS = re.compile(r"^(.*\.(self_attn\.o_proj|mlp\.(shared_experts\.)?down_proj|experts\.\d+\.(down_proj|w2)))\.bias$")
_NUMBER = re.compile(r"\.\d+(?=\.|$)")


def template(name: str) -> str:
    """The name with each number between dots replaced by `*`, as transformers' tp plans name parameters:
    `model.layers.3.mlp.experts.7.up_proj.weight` -> `model.layers.*.mlp.experts.*.up_proj.weight`."""
    return _NUMBER.sub(".*", name)


@dataclass(frozen=True)
class Split:
    """What each of `gpus` GPUs holds of which tensor, and which module outputs they combine."""

    gpus: int
    dims: dict[str, int]  # template -> the dim each GPU holds 1/gpus of, in checkpoint order
    reduce: tuple[str, ...]  # module templates whose outputs are summed over the GPUs, in checkpoint order
    gather: tuple[str, ...]  # modules whose outputs are concatenated along the last dim

    def dim_of(self, name: str) -> int | None:
        return self.dims.get(template(name))


def find_split(tensors: Mapping[str, TensorInfo], facts: ModelFacts, gpus: int) -> tuple[Split, list[str]]:
    """The split of `tensors` over `gpus` GPUs (module doc), and the problems that forbid it (one line each,
    naming the tensor or the config key and what to do)."""
    problems: list[str] = []
    plan = _COMPILED.get(facts.model_type or "")
    if plan is None:
        known = ", ".join(sorted(TP_PLANS))
        what = (f"model_type {facts.model_type!r}" if facts.model_type else
                "no model_type (or no config.json beside the checkpoint), so no tensor-parallel plan applies")
        problems.append(f"config.json: {what}: offplan knows transformers' tensor-parallel plan of {known} only; "
                        "plan this model on one GPU (`gpus: 1`)")
        return Split(gpus, {}, (), ()), problems
    heads = (("num_attention_heads", facts.heads), ("num_key_value_heads", facts.kv_heads))
    for key, count in heads if facts.model_type in _HEADS else ():
        if count is None:
            problems.append(f"config.json: no {key}: each GPU takes a whole share of the heads, and offplan cannot "
                            "tell them without it")
        elif count % gpus:
            problems.append(f"config.json: {key} is {count}, which {gpus} GPUs cannot share evenly: use a GPU "
                            f"count that divides it")
    dims: dict[str, int] = {}
    reduce: dict[str, None] = {}
    gather: list[str] = []
    odd: dict[str, str] = {}  # template -> a problem, reported once
    scales: set[str] = set()  # templates of FP8 scales
    for name, info in tensors.items():
        tpl = template(name)
        if tpl in odd:
            continue
        if tpl in dims:  # a template decided once; each of its tensors must divide too (layers may differ)
            if (problem := _undivided(name, info, dims[tpl], gpus, facts.fp8_block)) is not None:
                odd[tpl] = problem
            continue
        if name.endswith((MX_BLOCKS, MX_SCALES)) and info.dtype == "U8":
            odd[tpl] = (f"{name}: an MXFP4 tensor; tensor-parallel plans of MXFP4 checkpoints are not supported "
                        "(block-scaled FP8 ones are): plan it on one GPU")
            continue
        if name.endswith(FP8_SCALE) and (weight := tensors.get(name[:-len(FP8_SCALE)])) is not None \
                and weight.dtype in FP8:
            scales.add(tpl)  # split as its weight is, below
            continue
        if prefused_key(name) is not None:
            odd[tpl] = (f"{name}: experts stored already fused (one tensor of every expert); tensor parallelism "
                        "needs them stored one tensor each: plan it on one GPU")
            continue
        if _BIAS.match(name):
            odd[tpl] = (f"{name}: a rowwise projection's bias would be added once per GPU; tensor-parallel plans "
                        "of such models are not supported: plan it on one GPU")
            continue
        dim, module = _rule(plan, name)
        if dim is None and name == f"{HEAD}.weight" and not facts.tied:
            dim = 0
            gather.append(HEAD)
        if dim is None:
            continue
        if (problem := _undivided(name, info, dim, gpus, facts.fp8_block)) is not None:
            odd[tpl] = problem
            continue
        dims[tpl] = dim
        if module:
            reduce.setdefault(template(module))
    # FP8 scales split with their weights, each listed after its weight
    dims = {t: d for tpl, dim in dims.items() for t, d in ((tpl, dim), (tpl + FP8_SCALE, dim))
            if t == tpl or t in scales}
    problems += odd.values()
    if not dims and not odd:  # every GPU would hold everything: nothing gained, and not transformers' plan
        problems.append(f"no tensor is named as transformers' plan for {facts.model_type} names what it splits "
                        "(`model.layers.N.self_attn.q_proj.weight`, ...): nothing to split; plan it on one GPU")
    return Split(gpus, dims, tuple(reduce), tuple(gather)), problems


def _undivided(name: str, info: TensorInfo, dim: int, gpus: int, block: tuple[int, int]) -> str | None:
    """The problem when `gpus` GPUs cannot each hold an equal share of `name` along `dim`, else None; an FP8
    weight's share must be whole scale blocks (`block`: rows, columns; module doc)."""
    size = info.shape[dim] if dim < len(info.shape) else None
    rank = len(info.shape)
    if info.dtype in FP8 and size is not None and dim >= rank - 2:
        b = block[dim - (rank - 2)]
        if size % (gpus * b) == 0:
            return None
        return (f"{name}: {info.dtype}, its dim {dim} ({size}) does not divide into {gpus} shares of whole "
                f"{b}-element scale blocks (config.json's weight_block_size): use a GPU count whose shares hold "
                "whole blocks, or plan it on one GPU")
    if size is not None and size % gpus == 0:
        return None
    return (f"{name}: its dim {dim} ({'missing' if size is None else size}) does not divide by {gpus} GPUs: use a "
            "GPU count that divides it")


def _rule(plan, name: str) -> tuple[int | None, str]:
    for pattern, dim, reduce in plan:
        m = pattern.match(name)
        if m:
            return dim, m.expand(reduce) if reduce else ""
    return None, ""


def local_tensors(tensors: Mapping[str, TensorInfo], dims: Mapping[str, int], gpus: int
                  ) -> dict[str, TensorInfo]:
    """One GPU's view of the checkpoint: each tensor whose template `dims` names with that dim divided by
    `gpus` (its bytes too); the others as they are. Names, dtypes and order are kept; `offset` and `shard`
    still locate the whole tensor in its file."""
    if gpus == 1 or not dims:
        return dict(tensors)
    out = {}
    for name, info in tensors.items():
        dim = dims.get(template(name))
        if dim is None:
            out[name] = info
            continue
        shape = list(info.shape)
        shape[dim] //= gpus
        out[name] = info._replace(shape=tuple(shape), nbytes=info.nbytes // gpus)
    return out


def collectives(layers, split: Split, tensors: Mapping[str, TensorInfo], hidden: int | None,
                act_bytes: int = 2) -> dict[str, tuple[int, int]]:
    """Per layer of the graph: (collectives one forward makes, the bytes they move per token). A module of
    `split.reduce` sums `hidden` activations (each `act_bytes`: bf16), the head gathers its whole vocabulary's
    logits; the GPUs' copies of what they sum are not counted apart (the hardware figures are per collective)."""
    if split.gpus == 1:
        return {}
    reduce = {t: None for t in split.reduce}
    out = {}
    for layer in layers:
        count = per_token = 0
        seen: set[str] = set()
        for name in layer.params:
            dim = split.dims.get(tpl := template(name))
            if dim is None:
                continue
            module = next((r for r in reduce if tpl.startswith(r + ".")), None)
            if dim == 1 and module is not None and module not in seen:
                seen.add(module)
                width = hidden or tensors[name].shape[0]
                count, per_token = count + 1, per_token + width * act_bytes
            elif name == f"{HEAD}.weight" and HEAD in split.gather:
                count, per_token = count + 1, per_token + tensors[name].shape[0] * split.gpus * act_bytes
        if count:
            out[layer.name] = (count, per_token)
    return out

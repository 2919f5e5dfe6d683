"""Experts stored already fused: one checkpoint tensor holds a parameter of every expert of a layer.

Why (issue 12): most MoE checkpoints store one tensor per expert
(`mlp.experts.7.up_proj.weight`, groups.py), but some store each expert
parameter stacked along a first dimension of E experts, as transformers
holds it at run time:
- GPT-OSS: `mlp.experts.gate_up_proj` [E, H, 2I], `gate_up_proj_bias` [E, 2I],
  `down_proj` [E, I, H], `down_proj_bias` [E, H]; gpt-oss-120b as released
  stores the weights in MXFP4, `gate_up_proj_blocks` [E, 2I, H/32, 16] and
  `gate_up_proj_scales` [E, 2I, H/32] (U8), likewise `down_proj_*`;
- Llama 4: `language_model.model.layers.N.feed_forward.experts.gate_up_proj`
  [E, H, 2I] and `down_proj` [E, I, H].
A decode step reads only the rows of the experts that routing picks (4 of
gpt-oss-120b's 128 at batch 1), so a cost model that read such a tensor whole
would count 32x its traffic.

By name (`prefused_key`): `<prefix>.experts.<param>` whose first segment after
`experts` is not a number belongs to the fused expert group `<prefix>.experts`
(groups.py), like the per-expert tensors of that module. Names alone decide
membership, so whoever sees only a plan's names (the runtime's prefill
staging, the plan's consistency check, `plan show`) agrees with the planner:
a group's tensors are never staged at prefill and a group is prefetched whole.

By shape (`expert_rows`): a member's rows are experts when its first dimension
is the group's expert count E, taken from
1. config.json (`num_local_experts`, `num_experts`, `n_routed_experts`; config.py);
2. else the number of per-expert tensors' experts, if the group has such;
3. else the first dimension its stacked tensors share, provided one of them
   is at least 3-D (a stack of matrices; DBRX's `ffn.experts.mlp.w1`
   [E x I, H] is 2-D and flat, and is no stack of experts).
Only then does the cost model (cost.py) count the touched experts' rows of
it; a member that fails the check is read whole (dense), and the plan's
notes say which and why.

The unit: the plan is keyed by checkpoint tensor names, and a pre-fused
tensor is one name, so it is placed whole: it is its own parameter and its
own expert unit (groups.py), and a budget cannot keep some of its experts on
the GPU and read the others in place, as it can for per-expert tensors. A
rule that names experts by number finds no tensor to match (build.py says
why).

Limits: experts are found under a module named `experts` only (Granite's
`block_sparse_moe.input_linear` [E, 2I, H] is not seen, and is read whole);
the cost model assumes the model reads the rows of routed experts only,
which offplan's experts implementation and vLLM do, but not every
transformers class (Llama 4's experts module multiplies every expert's
weights for every token in transformers 5.17, so in place it reads the whole
tensor); DBRX's config nests its expert count (`ffn_config`), which is not read.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

_PREFUSED = re.compile(r"^(.*\.experts)\.(?!\d+(?:\.|$))(.+)$")


def prefused_key(name: str) -> tuple[str, str] | None:
    """(group, parameter) of a tensor stored for every expert at once, by name, or None.

    >>> prefused_key("model.layers.0.mlp.experts.gate_up_proj_blocks")
    ('model.layers.0.mlp.experts', 'gate_up_proj_blocks')
    >>> prefused_key("model.layers.0.mlp.experts.7.up_proj.weight") is None
    True
    """
    m = _PREFUSED.match(name)
    return None if m is None else (m[1], m[2])


def expert_rows(stacked: Mapping[str, Sequence[str]], shapes: Mapping[str, tuple[int, ...]],
                counted: Mapping[str, int], configured: int | None) -> tuple[dict[str, int], dict[str, str]]:
    """Which pre-fused tensors hold one expert per row of their first dimension (module doc).

    `stacked`: group -> its pre-fused members; `counted`: group -> its per-expert
    tensors' experts (0 or absent: none); `configured`: config.json's expert count.
    Returns (member -> E, for those that pass; member -> why not, for the others).
    """
    rows: dict[str, int] = {}
    rejected: dict[str, str] = {}
    for group, names in stacked.items():
        lead = {n: (shapes[n][0] if shapes[n] else None) for n in names}
        if configured is not None:
            want, source = configured, f"the {configured} experts of config.json"
        elif counted.get(group):
            want, source = counted[group], f"the {counted[group]} experts of {group}'s per-expert tensors"
        elif len(set(lead.values())) > 1:
            firsts = ", ".join(str(d) for d in sorted({d for d in lead.values() if d is not None}))
            rejected.update((n, f"{group}'s tensors disagree on their first dimension ({firsts}) and config.json "
                                "gives no expert count") for n in names)
            continue
        elif not any(len(shapes[n]) >= 3 for n in names):
            rejected.update((n, f"none of {group}'s tensors is a stack of matrices (3-D or more) and config.json "
                                "gives no expert count") for n in names)
            continue
        else:
            want, source = next(iter(lead.values())), None
        for n in names:
            if lead[n] == want:
                rows[n] = want
            else:
                rejected[n] = (f"its first dimension is {lead[n]}, not {source}" if lead[n] is not None
                               else "it is a scalar")
    return rows, rejected

"""Recording a routing profile: which experts a model's router picks, per MoE layer and phase.

`RoutingRecorder(model)` registers forward pre-hooks, the framework's own
mechanism, and changes nothing the model computes:

- one on the model itself, which says the phase of the forward that starts:
  a prefill when its input has more than one token per sequence, a decode
  step otherwise, and counts its tokens;
- one on every experts module that dispatches through transformers' experts
  interface (`runtime.execute.experts.supports`), whose forward gets
  `(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`: the
  hook adds one to each routed expert's count for the phase
  (`index_add_`, a bincount that stays on the device: no host synchronization
  per layer, so recording does not slow the generation it watches).

`remove()` removes every hook. Counts are read once, at the end (`profile`).

`record_routing(model, prompts, new_tokens, ...)` runs greedy `generate`
over the prompts one at a time (batch 1: no padding token is routed and
counted) and returns the profile (planner/inputs/routing.py), checked like a file
read from disk. Layers are keyed by the experts module's path, or by the
checkpoint's expert group when the two differ (Mixtral's `block_sparse_moe`
is transformers' `mlp`): `checkpoint_groups` maps them, so that the planner,
which knows only checkpoint names, finds every layer.

Limits: a prompt of a single token cannot be told from a decode step, so
prompts need two tokens or more; every prompt is continued for exactly
`new_tokens` tokens (an EOS does not stop it), so that runs compare.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from planner.errors import OffplanError
from planner.inputs.checkpoint import Checkpoint
from planner.inputs.routing import PHASES, LayerHits, RoutingProfile, inconsistencies
from planner.layers.groups import FusedGroups
from planner.plan import Placement

from ..execute.experts import fused_params, supports
from ..place.names import map_tensors


class RoutingRecorder:
    """Counts per experts module and phase the tokens routed to each expert (module doc).

    Lifecycle: construct (hooks registered) -> run the model -> `profile(...)` -> `remove()`.
    Also a context manager that removes its hooks on exit.
    """

    def __init__(self, model: torch.nn.Module, keys: Mapping[str, str] | None = None):
        """`keys`: experts module path -> the name its layer gets in the profile (default: the path)."""
        self.model = model
        self.phase = "prefill"
        self.tokens = dict.fromkeys(PHASES, 0)
        self.experts: dict[str, int] = {}  # layer key -> experts
        self.top_k: set[int] = set()
        self.counts: dict[tuple[str, str], torch.Tensor] = {}  # (layer key, phase) -> [E] int64, on the device
        self.handles = [model.register_forward_pre_hook(self._on_model, with_kwargs=True)]
        for path, module in model.named_modules():
            if module is not model and supports(module):
                key = (keys or {}).get(path, path)
                self.experts[key] = int(module.num_experts)
                self.handles.append(module.register_forward_pre_hook(self._counter(key), with_kwargs=True))
        if not self.experts:
            self.remove()
            raise OffplanError(f"{type(model).__name__} has no experts module that dispatches through "
                               "transformers' experts interface: there is no routing to record")

    def _on_model(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"]
        sequences, length = ids.shape[0], ids.shape[1]
        self.phase = "prefill" if length > 1 else "decode"
        self.tokens[self.phase] += sequences * length

    def _counter(self, key: str):
        def hook(module, args, kwargs) -> None:
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]  # [T, k]
            self.top_k.add(index.shape[-1])
            flat = index.reshape(-1)
            acc = self.counts.get((key, self.phase))
            if acc is None:
                acc = self.counts[(key, self.phase)] = torch.zeros(self.experts[key], dtype=torch.int64,
                                                                   device=flat.device)
            acc.index_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
        return hook

    def hits(self) -> dict[str, dict[str, list[int]]]:
        """Layer key -> phase -> per-expert counts so far (one host synchronization)."""
        return {key: {phase: (self.counts[(key, phase)].tolist() if (key, phase) in self.counts else [0] * e)
                      for phase in PHASES} for key, e in self.experts.items()}

    def profile(self, *, checkpoint_fingerprint: str, checkpoint_path: str = "", prompts: str, sequences: int,
                new_tokens: int) -> RoutingProfile:
        """The counts so far as a profile; raises OffplanError if they break a profile's rules
        (planner/inputs/routing.py `inconsistencies`: e.g. a model that routes some tokens to fewer experts)."""
        if len(self.top_k) > 1:
            raise OffplanError(f"the experts modules route to different numbers of experts ({sorted(self.top_k)}); "
                               "a routing profile holds one top_k")
        hits = self.hits()
        profile = RoutingProfile(
            checkpoint_path=checkpoint_path, checkpoint_fingerprint=checkpoint_fingerprint, prompts=prompts,
            sequences=sequences, new_tokens=new_tokens, top_k=next(iter(self.top_k), 1),
            prefill_tokens=self.tokens["prefill"], decode_tokens=self.tokens["decode"],
            layers={k: LayerHits(self.experts[k], tuple(h["decode"]), tuple(h["prefill"])) for k, h in hits.items()})
        problems = inconsistencies(profile)
        if problems:
            raise OffplanError("the recorded routing does not make a routing profile", problems)
        return profile

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def __enter__(self) -> "RoutingRecorder":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def record_routing(model: torch.nn.Module, prompts: Iterable[torch.Tensor], new_tokens: int, *,
                   checkpoint_fingerprint: str, checkpoint_path: str = "", source: str = "prompts",
                   keys: Mapping[str, str] | None = None) -> RoutingProfile:
    """Greedy `generate` of `new_tokens` tokens after each prompt (1-D token ids, two or more), one
    prompt at a time, with a RoutingRecorder on; returns the profile (`source` says where the prompts
    came from, e.g. "prompts.txt"). Write it with `planner.inputs.routing.write_profile(path, profile)`."""
    prompts = list(prompts)
    if not prompts:
        raise OffplanError("no prompts to record routing with")
    short = [i for i, p in enumerate(prompts) if p.numel() < 2]
    if short:
        raise OffplanError(f"prompt {short[0] + 1} has {prompts[short[0]].numel()} token(s): a prompt needs two "
                           "or more, or its prefill cannot be told from a decode step")
    if new_tokens < 2:
        raise OffplanError(f"new_tokens is {new_tokens}: the first new token comes from the prefill, so recording "
                           "decode routing needs 2 or more")
    device = next(model.parameters()).device
    with RoutingRecorder(model, keys) as recorder, torch.no_grad():
        for ids in prompts:
            ids = ids.reshape(1, -1).to(device)
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=model.generation_config.pad_token_id or 0)
        return recorder.profile(checkpoint_fingerprint=checkpoint_fingerprint, checkpoint_path=checkpoint_path,
                                prompts=source, sequences=len(prompts), new_tokens=new_tokens)


def checkpoint_groups(model: torch.nn.Module, checkpoint: Checkpoint) -> dict[str, str]:
    """Experts module path -> its checkpoint expert group (planner/layers/groups.py), for modules whose
    checkpoint tensors are stored one expert each; found through transformers' own conversion
    (checkpoint_names.py), which says which checkpoint tensors fill each fused parameter."""
    modules = {path for path, m in model.named_modules() if supports(m)}
    wanted = {f"{path}.{fused_params(model.get_submodule(path))[0]}": path for path in modules}
    targets = map_tensors(model, {n: (t.shape, Placement.GPU) for n, t in checkpoint.tensors.items()})
    out = {}
    for t in targets:
        if t.name in wanted:
            source = t.pieces[0].source
            group = FusedGroups.find([source]).group_of.get(source)
            if group is not None:
                out[wanted[t.name]] = group
    return out

"""Routing profiles (format 1): which experts a workload's tokens go to, per MoE layer.

Why: a router is not uniform. Some experts take a large share of the tokens,
others almost none, so which experts stay on the GPU decides how many bytes
cross the host link per decode step. `plan profile` (offplan/running.py, with
runtime/measure/routing.py) runs prompts through the model and counts, per MoE layer
and per expert, the tokens routed to it, decode steps and prefill apart; a
policy names the file (`workload.routing: FILE`), and the cost model reads
each expert's share of decode tokens from it (cost.py), which `backend: mixed`
ranks experts by, and its share of prefill tokens for the prefill prediction.

The file is deterministic YAML, one line per layer per phase:

    format_version: 1
    checkpoint:
      path: Qwen3-30B-A3B                  # as recorded, relative to the profile
      fingerprint: "sha256:..."            # the checkpoint's, as plans record it
    recorded:
      prompts: prompts.txt                 # or "random token ids, 32 each, seed 0"
      sequences: 8                         # prompts, run one at a time
      new_tokens: 32                       # generated per prompt
      top_k: 8                             # experts per token
    tokens:
      prefill: 1024                        # tokens of forwards of more than one token per sequence
      decode: 248                          # tokens of one-token forwards
    layers:
      model.layers.0.mlp.experts:          # the checkpoint's expert group (groups.py)
        experts: 128
        decode: [12, 0, 3, ...]            # per expert: decode tokens routed to it
        prefill: [40, 7, 0, ...]

Each layer's counts of a phase add up to that phase's tokens x top_k (a token
takes top_k distinct experts, so no expert takes more than every token).
`load_profile` checks that, with `file:line:column` messages; `mismatches`
checks a profile against a checkpoint's expert groups.

Limits: the profile describes the prompts it was recorded on, nothing more;
the cost model predicts decode steps from the decode counts and the prefill
from the prefill counts, and treats the tokens of a batch, or of a prompt, as
routed independently of each other.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import RoutingProfileError
from ..files import write_atomic
from . import yamlio
from .schema import validate

FORMAT_VERSION = 1
HEADER = ("# offplan routing profile: written by `plan profile`; a policy names it as `workload.routing: FILE`.\n"
          "# Per MoE layer: the tokens routed to each expert, in decode steps and in prefill apart.\n")
PHASES = ("decode", "prefill")
TOP_SHARE = 0.1  # skew is the share of hits that the most-hit 10% of each layer's experts take


@dataclass(frozen=True)
class LayerHits:
    """One MoE layer of a profile: per expert, the tokens routed to it in each phase."""

    experts: int
    decode: tuple[int, ...]
    prefill: tuple[int, ...]


@dataclass(frozen=True)
class RoutingProfile:
    """A routing profile, parsed and checked (`load_profile`), or recorded (runtime/measure/routing.py)."""

    checkpoint_path: str  # as recorded, relative to the profile file, e.g. "Qwen3-30B-A3B"
    checkpoint_fingerprint: str  # "sha256:..." of the checkpoint it was recorded on
    prompts: str  # where the prompts came from, e.g. "prompts.txt"
    sequences: int  # prompts run, one at a time
    new_tokens: int  # generated per prompt
    top_k: int  # experts per token
    prefill_tokens: int
    decode_tokens: int
    layers: Mapping[str, LayerHits]  # experts module (checkpoint group) -> hits, in model order
    path: Path | None = field(default=None, compare=False)  # the file it was read from
    fingerprint: str | None = field(default=None, compare=False)  # of that file (`profile_fingerprint`)

    def probabilities(self, layer: str, phase: str = "decode") -> tuple[float, ...]:
        """Per expert of `layer`, the chance that a token of `phase` (decode or prefill) is routed to it;
        they add up to top_k."""
        tokens = getattr(self, f"{phase}_tokens")
        return tuple(h / tokens for h in getattr(self.layers[layer], phase))


def profile_fingerprint(text: str) -> str:
    """The fingerprint a plan records for its routing profile: sha256 of the file's text."""
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------- writing

def dumps_profile(profile: RoutingProfile) -> str:
    """The profile as its file holds it (module doc); `load_profile` reads it back equal."""
    s = yamlio.scalar
    out = [HEADER, f"format_version: {FORMAT_VERSION}\n",
           "checkpoint:\n", f"  path: {s(profile.checkpoint_path)}\n",
           f"  fingerprint: {s(profile.checkpoint_fingerprint)}\n",
           "recorded:\n", f"  prompts: {s(profile.prompts)}\n", f"  sequences: {profile.sequences}\n",
           f"  new_tokens: {profile.new_tokens}\n", f"  top_k: {profile.top_k}\n",
           "tokens:\n", f"  prefill: {profile.prefill_tokens}\n", f"  decode: {profile.decode_tokens}\n",
           "layers:\n"]
    for name, hits in profile.layers.items():
        out += [f"  {s(name)}:\n", f"    experts: {hits.experts}\n",
                f"    decode: [{', '.join(map(str, hits.decode))}]\n",
                f"    prefill: [{', '.join(map(str, hits.prefill))}]\n"]
    return "".join(out)


def write_profile(path: str | Path, profile: RoutingProfile) -> None:
    """Write the profile atomically (temp file + rename): never half a file."""
    write_atomic(Path(path), dumps_profile(profile), "routing profile")


# ---------------------------------------------------------------- reading

def load_profile(path: str | Path) -> RoutingProfile:
    """Read, validate and type a routing profile; raises RoutingProfileError listing every problem."""
    path = Path(path)
    text, doc = yamlio.load_mapping(path, RoutingProfileError, "routing profile",
                                    "record one with `plan profile CHECKPOINT -o FILE`")
    validate(doc, "routing.schema.json", RoutingProfileError, f"{path}: the routing profile is invalid")
    d = doc.data
    rec, tokens = d["recorded"], d["tokens"]
    profile = RoutingProfile(
        checkpoint_path=d["checkpoint"]["path"],
        checkpoint_fingerprint=d["checkpoint"]["fingerprint"],
        prompts=rec["prompts"], sequences=rec["sequences"], new_tokens=rec["new_tokens"], top_k=rec["top_k"],
        prefill_tokens=tokens["prefill"], decode_tokens=tokens["decode"],
        layers={name: LayerHits(h["experts"], tuple(h["decode"]), tuple(h["prefill"]))
                for name, h in d["layers"].items()},
        path=path, fingerprint=profile_fingerprint(text))
    problems = inconsistencies(profile, doc.where)
    if problems:
        raise RoutingProfileError(f"{path}: the routing profile is inconsistent (edited by hand?); record it "
                                  "again with `plan profile`", problems)
    return profile


def inconsistencies(profile: RoutingProfile, where=lambda key_path: "") -> list[str]:
    """What a profile's counts say against each other, one line per problem (module doc).

    `where(key_path)` locates a key (`file:line:column`) for the message; recording
    (runtime/measure/routing.py) checks its own result through here too.
    """
    problems = []

    def problem(key_path: list, text: str) -> None:
        at = where(key_path)
        problems.append(f"{at + ': ' if at else ''}{yamlio.dotted(key_path)}: {text}")

    if profile.decode_tokens == 0:
        problem(["tokens", "decode"], "no decode tokens: the cost model reads decode routing; record with "
                                      "`plan profile --new-tokens 2` or more")
    for name, hits in profile.layers.items():
        for phase in PHASES:
            counts, tokens = getattr(hits, phase), getattr(profile, f"{phase}_tokens")
            key = ["layers", name, phase]
            if len(counts) != hits.experts:
                problem(key, f"{len(counts)} counts, but the layer has {hits.experts} experts (`experts:`)")
            if sum(counts) != tokens * profile.top_k:
                problem(key, f"the counts add up to {sum(counts)}, but each of the {tokens} {phase} tokens "
                             f"(tokens.{phase}) takes {profile.top_k} experts (recorded.top_k): "
                             f"{tokens * profile.top_k}")
            over = [(e, c) for e, c in enumerate(counts) if c > tokens]
            if over:
                e, c = over[0]
                problem(key, f"expert {e} took {c} of the {tokens} {phase} tokens: a token takes an expert at "
                             "most once")
    return problems


def mismatches(profile: RoutingProfile, experts: Mapping[str, int]) -> list[str]:
    """Why `profile` does not fit a checkpoint whose MoE layers (expert groups that run in decode)
    have `experts[group]` experts each, one line per layer; [] when it fits."""
    problems = []
    for group, count in experts.items():
        hits = profile.layers.get(group)
        if hits is None:
            problems.append(f"{group}: the profile has no counts for this MoE layer of the checkpoint")
        elif hits.experts != count:
            problems.append(f"{group}: the profile counts {hits.experts} experts, the checkpoint has {count}")
    problems += [f"{name}: the profile counts this layer, which is no MoE layer of the checkpoint"
                 for name in profile.layers if name not in experts]
    return problems


# ---------------------------------------------------------------- skew

@dataclass(frozen=True)
class Skew:
    """How concentrated a phase's routing is: the share of hits the most-hit ~10% of each layer's
    experts take, against what they would take if routing were uniform."""

    top: int  # experts counted in a layer of the most experts (round(10%), at least 1)
    experts: int  # experts of that layer
    share: float  # of the phase's hits, over every layer
    uniform: float  # the share the same experts would take under uniform routing

    def text(self, phase: str = "decode") -> str:
        """`each layer's 13 most-hit experts (of 128) take 41.2% of decode hits (10.2% if uniform)`."""
        which = ("each layer's most-hit expert" if self.top == 1 else f"each layer's {self.top} most-hit experts")
        return (f"{which} (of {self.experts}) take{'s' if self.top == 1 else ''} {self.share:.1%} of {phase} "
                f"hits ({self.uniform:.1%} if uniform)")


def skew(profile: RoutingProfile, phase: str = "decode") -> Skew:
    hits = taken = top_all = experts_all = 0
    widest = max(profile.layers.values(), key=lambda h: h.experts)
    for layer in profile.layers.values():
        counts = getattr(layer, phase)
        top = max(1, round(layer.experts * TOP_SHARE))
        hits += sum(counts)
        taken += sum(sorted(counts, reverse=True)[:top])
        top_all += top
        experts_all += layer.experts
    return Skew(max(1, round(widest.experts * TOP_SHARE)), widest.experts, taken / hits if hits else 0.0,
                top_all / experts_all)


def check_fits(profile: RoutingProfile, experts: Mapping[str, int], top_k: int | None, named_at: str,
               checkpoint: Path) -> None:
    """Raise RoutingProfileError unless `profile` counts exactly the checkpoint's MoE layers
    (`experts`: group -> experts, those that run in decode) with the plan's top-k.

    `named_at` locates the policy's `workload.routing`; the message says how to record a
    profile of this checkpoint instead.
    """
    problems = mismatches(profile, experts)
    if top_k is not None and top_k != profile.top_k:
        problems.append(f"recorded.top_k: each of the profile's tokens took {profile.top_k} experts, but the "
                        f"plan assumes {top_k} (workload.experts_per_token, else the checkpoint's config.json)")
    if problems:
        raise RoutingProfileError(
            f"{named_at}: workload.routing: {profile.path} does not fit the checkpoint {checkpoint} (a profile of "
            f"another model?); record one of this checkpoint: plan profile {checkpoint} -o {profile.path}", problems)

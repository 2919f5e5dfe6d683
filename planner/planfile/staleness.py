"""Is a plan stale? The one answer behind `plan check` and the runtime's refusal to load.

A plan records fingerprints of its inputs (checkpoint.py: the index and every
shard header; policy.py: the policy file's bytes; routing.py: the routing
profile's bytes, when the policy names one). It is stale when

1. its checkpoint changed: the only reason the runtime refuses a plan
   (`require_current`), since the weights it would load are not the ones the
   plan was made for;
2. its policy or its routing profile changed or is gone, or the hardware profile
   its policy names is gone: the plan no longer says what they ask (a profile
   decides which experts stay on the GPU);
3. all are unchanged, but the plan is not what `plan build` makes of them
   (edited by hand, or built by another offplan version or hardware profile).

`plan check` reports all three (`stale_reasons`); the runtime checks only the
first, through the same function (`checkpoint_change`), so the two say it alike.

`plan check` first asks `up_to_date`: is the file byte for byte what `plan
build` makes of its inputs now? If so, the plan is current, and every check
`read_plan` and `stale_reasons` would run passes: a plan `plan build` makes
passes the schema and consistency checks (tests/planfile/test_up_to_date.py
holds this for the plans the tests build), and its fingerprints are its
inputs'. The plan's stamp answers it from the inputs' bytes alone
(planner/provenance.py: built by this offplan version, not edited, every
input's fingerprint the recorded one), reading each shard's header bytes and
parsing none. Without a stamp that answers yes (none, another version, a
changed input), or with `rebuild`, one header read and one build answer it.
Any other answer ("no", or an input that cannot be read) leaves it to the
full checks, which say what is wrong.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from ..decide.build import build
from ..errors import OffplanError, PlanFileError, PolicyError, RoutingProfileError, StalePlanError
from ..inputs import yamlio
from ..inputs.checkpoint import Checkpoint, fingerprint, open_checkpoint, resolve
from ..inputs.policy import beside, load_policy, policy_fingerprint
from ..inputs.routing import profile_fingerprint
from ..nogc import no_gc
from ..plan import Plan
from ..provenance import inputs_fingerprint, signed, unstamped, version
from .file import dumps


def checkpoint_change(plan: Plan, ckpt: Checkpoint, where: Path) -> str | None:
    """Why `ckpt` (read from `where`) is not the checkpoint the plan was built for, or None."""
    if ckpt.fingerprint == plan.checkpoint_fingerprint:
        return None
    return (f"the checkpoint {where} changed since the plan was built (fingerprint {ckpt.fingerprint[:19]}..., "
            f"the plan has {plan.checkpoint_fingerprint[:19]}...)")


def require_current(plan: Plan, ckpt: Checkpoint, where: Path) -> None:
    """Raise StalePlanError if the checkpoint changed since the plan was built; the runtime asks before it loads."""
    change = checkpoint_change(plan, ckpt, where)
    if change:
        raise StalePlanError(f"the plan is stale: {change}; rebuild it from its policy: `plan build "
                             f"{plan.policy_path}` (the path as the plan records it, relative to the plan)")


def stale_reasons(plan: Plan, plan_path: Path, ckpt: Checkpoint) -> list[str]:
    """Every reason the plan at `plan_path` is stale (see the module doc); [] if it is current."""
    problems = []
    change = checkpoint_change(plan, ckpt, plan.checkpoint_dir(plan_path))
    if change:
        problems.append(change)
    policy_path = plan_path.parent / plan.policy_path
    if policy_path.is_file():
        # Only the bytes matter: an edited policy is stale even if it no longer validates.
        text = yamlio.read(policy_path, PolicyError, "policy")
        if policy_fingerprint(text) != plan.policy_fingerprint:
            problems.append(f"the policy {policy_path} changed since the plan was built")
        elif (hardware := _gone_hardware(policy_path, text)) is not None:
            problems.append(f"the hardware profile {hardware} named by the policy is gone")
    else:
        problems.append(f"the policy {policy_path} named by the plan is gone")
    if plan.routing is not None:
        routing_path = plan_path.parent / plan.routing.path
        if not routing_path.is_file():
            problems.append(f"the routing profile {routing_path} named by the plan is gone")
        elif _profile_fingerprint(routing_path) != plan.routing.fingerprint:
            problems.append(f"the routing profile {routing_path} changed since the plan was built")
    if problems:
        return problems
    policy = load_policy(policy_path)
    fresh = build(policy, plan_path.parent, ckpt)
    text = plan_path.read_text()
    if not _rebuilds_to(fresh, text):
        moved = [n for n, p in fresh.params.items() if plan.params.get(n) is not p]
        where = (f" ({len(moved)} placements differ, e.g. {moved[0]}: the plan says {plan.params[moved[0]].value}, "
                 f"the policy gives {fresh.params[moved[0]].value})" if moved and moved[0] in plan.params else "")
        b, offplan = plan.built, version()
        why = ("edited by hand, or built with another hardware profile, config.json or offplan version"
               if b is None or b.offplan != offplan or not signed(text)
               or b.inputs == inputs_fingerprint(offplan, policy.hardware, ckpt.root) else
               "the checkpoint's config.json changed since it was built" if policy.hardware is None else
               f"the hardware profile {policy.hardware} or the checkpoint's config.json changed since it was built")
        problems.append(f"the plan is not what `plan build` makes of its policy and checkpoint ({why}){where}")
    return problems


def _gone_hardware(policy_path: Path, text: str) -> Path | None:
    """The hardware profile the policy's `hardware:` names (policy.py `beside`), where it is gone: the
    policy then no longer loads, and the plan is stale as with a gone routing profile."""
    try:
        name = yaml.safe_load(text).get("hardware")
    except (yaml.YAMLError, AttributeError):
        return None  # not a mapping: whatever checks the policy says so
    path = beside(policy_path, name) if isinstance(name, str) else None
    return path if path is not None and not path.is_file() else None


def stale_but_loadable(plan: Plan, plan_path: Path) -> list[str]:
    """Why `plan check` would call the plan stale, where the runtime still loads it (its checkpoint unchanged:
    a changed policy, routing profile, hardware profile or config.json, a hand edit); [] where it is current, where
    the checkpoint changed (the runtime refuses that, saying so) and where an input cannot be read (the load says
    what). `plan apply` warns with it: the plan is applied as it is, never re-decided."""
    try:
        current = _stamp_holds(*_head(plan_path))  # current by its stamp: no build (stale_reasons builds once)
    except _UNREADABLE:
        current = False  # its policy or routing profile gone, or unreadable: stale_reasons says which
    if current:
        return []
    try:
        ckpt = open_checkpoint(checkpoint_of(plan, plan_path))
        if checkpoint_change(plan, ckpt, plan.checkpoint_dir(plan_path)):
            return []
        return stale_reasons(plan, plan_path, ckpt)
    except _UNREADABLE:
        return []  # as up_to_date: whatever cannot be read is the load's to say


def checkpoint_of(plan: Plan, plan_path: Path) -> Path:
    """Where the plan's checkpoint is (its `checkpoint.path`, relative to the plan); an error saying so where
    nothing is there."""
    where = plan.checkpoint_dir(plan_path)
    if not where.exists():
        raise PlanFileError(f"{plan_path}: its checkpoint {where} (checkpoint.path: {plan.checkpoint_path}, relative "
                            "to the plan) is missing: put it back there, or build the plan again from a policy that "
                            "names where it is now")
    return where


@dataclass(frozen=True)
class Inputs:
    """Where a plan's inputs are, as `plan check` names them."""

    checkpoint: Path
    policy: Path
    routing: Path | None


def up_to_date(plan_path: Path, rebuild: bool = False) -> Inputs | None:
    """The plan's inputs when the file at `plan_path` is byte for byte what `plan build` makes of them now
    (module doc): by its stamp, or (`rebuild`, or no stamp that says so) by building it again; None when it
    is not, or when something cannot be read: the full checks then say why.

    The plan's head (before `notes:`) names the inputs; a head that misnames them gives another plan,
    which is then not the file."""
    with no_gc():
        try:
            head, text, where = _head(plan_path)
            if not rebuild and _stamp_holds(head, text, where):
                return where
            fresh = build(load_policy(where.policy), plan_path.parent, open_checkpoint(where.checkpoint))
        except _UNREADABLE:
            return None
        return where if _rebuilds_to(fresh, text) else None


def _rebuilds_to(fresh: Plan, text: str) -> bool:
    """Whether the plan built again is `text`, byte for byte (an uninstalled offplan stamps nothing: the text
    less its stamp, then)."""
    return dumps(fresh) == (text if fresh.built is not None else unstamped(text))


_UNREADABLE = (OffplanError, OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError)


def _head(plan_path: Path) -> tuple[dict, str, Inputs]:
    """The plan's head (before `notes:`, parsed), its text, and where its inputs are; raises one of _UNREADABLE."""
    text = plan_path.read_text(encoding="utf-8")
    cut = text.find("\nnotes:")
    head = yamlio.parse(plan_path, text[:cut], PlanFileError).data if cut > 0 else None
    where = Inputs(plan_path.parent / head["checkpoint"]["path"], plan_path.parent / head["policy"]["path"],
                   None if head.get("routing") is None else plan_path.parent / head["routing"]["path"])
    return head, text, where


def _stamp_holds(head: dict, text: str, where: Inputs) -> bool:
    """Whether the plan's stamp says it is what `plan build` makes now (planner/provenance.py): this version
    built it, no edit since, and every input where the plan names it, with the recorded fingerprint."""
    built, offplan = head.get("built"), version()
    if not built or offplan is None or built["offplan"] != offplan or not signed(text):
        return False
    policy = load_policy(where.policy)
    root = _resolved(where.checkpoint)
    if policy.fingerprint != head["policy"]["fingerprint"] or _resolved(policy.checkpoint) != root:
        return False  # (the policy names the plan's checkpoint)
    routing = policy.workload.routing
    if (routing is None) != (where.routing is None) or routing is not None and (
            routing.resolve() != where.routing.resolve()
            or _profile_fingerprint(routing) != head["routing"]["fingerprint"]):
        return False
    return (inputs_fingerprint(offplan, policy.hardware, root[0]) == built["inputs"]
            and fingerprint(where.checkpoint) == head["checkpoint"]["fingerprint"])


def _profile_fingerprint(path: Path) -> str:
    return profile_fingerprint(yamlio.read(path, RoutingProfileError, "routing profile"))


def _resolved(path: Path) -> tuple:
    """A checkpoint's (directory, index, shards) as `resolve` finds them, the paths made absolute and real."""
    root, index, shards = resolve(path)
    return root.resolve(), None if index is None else index.resolve(), shards

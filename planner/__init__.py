"""offplan's planner: safetensors headers + a YAML policy -> an explicit per-parameter plan.

Pure Python: it never imports torch and never reads weight data. Its stages, each importing only those before it:
inputs/ (read and validate what was asked) -> layers/ (what the names form) -> decide/ (placements, the plan) ->
planfile/ (the plan as a file, checked, shown and diffed). errors, files, plan (the plan's types) and units are
shared by all of them. The names below are the planner's public API.
"""
from .decide.build import build, build_file
from .errors import (BudgetError, CheckpointError, InconsistentPlanError, InputError, ModelMismatchError, OffplanError,
                     PlanFileError, PolicyError, RoutingProfileError, StalePlanError)
from .files import write_atomic
from .inputs.checkpoint import Checkpoint, TensorInfo, open_checkpoint
from .inputs.policy import Policy, load_policy
from .inputs.routing import RoutingProfile, dumps_profile, load_profile, write_profile
from .plan import Backend, Placement, Plan
from .planfile import dumps, load_plan, loads, read_plan

__all__ = ["build", "build_file", "Checkpoint", "TensorInfo", "open_checkpoint", "BudgetError",
           "CheckpointError", "InconsistentPlanError", "InputError", "ModelMismatchError", "OffplanError",
           "PlanFileError", "PolicyError", "StalePlanError", "Plan", "dumps", "load_plan", "loads", "read_plan",
           "write_atomic", "Backend", "Placement", "Policy", "load_policy", "RoutingProfileError", "RoutingProfile",
           "dumps_profile", "load_profile", "write_profile"]

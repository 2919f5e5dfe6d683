"""offplan's planner: safetensors headers + a YAML policy -> an explicit per-parameter plan.

Pure Python: it never imports torch and never reads weight data.
"""
from .build import build, build_file
from .checkpoint import Checkpoint, TensorInfo, open_checkpoint
from .errors import (BudgetError, CheckpointError, InconsistentPlanError, InputError, ModelMismatchError,
                     OffplanError, PlanFileError, PolicyError, RoutingProfileError, StalePlanError)
from .files import write_atomic
from .plan import Backend, Placement, Plan
from .planfile import dumps, load_plan, loads, read_plan
from .policy import Policy, load_policy
from .routing import RoutingProfile, dumps_profile, load_profile, write_profile

__all__ = ["build", "build_file", "Checkpoint", "TensorInfo", "open_checkpoint", "BudgetError",
           "CheckpointError", "InconsistentPlanError", "InputError", "ModelMismatchError", "OffplanError",
           "PlanFileError", "PolicyError", "StalePlanError", "Plan", "dumps", "load_plan", "loads", "read_plan",
           "write_atomic", "Backend", "Placement", "Policy", "load_policy", "RoutingProfileError", "RoutingProfile",
           "dumps_profile", "load_profile", "write_profile"]

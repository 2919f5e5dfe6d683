"""The plan as a file, and its review: deterministic YAML on disk, the consistency and staleness checks every
reader runs, and what `plan show` and `plan diff` print.

Takes a `Plan` (planner.plan) or a plan file; gives its bytes, a checked `Plan`, or tables for people. Uses
planner.decide to recompute what a plan claims (staleness rebuilds it; consistency re-derives its summaries).
"""
from .file import LoadedPlan, dumps, load_plan, loads, read_plan

__all__ = ["LoadedPlan", "dumps", "load_plan", "loads", "read_plan"]

"""Reading what was asked: the policy, the checkpoint's index and shard headers, its config.json, and the
hardware and routing profiles, each validated at the boundary (YAML -> JSON Schema -> frozen dataclasses).

Takes files; gives typed inputs (`Policy`, `Checkpoint`, `ModelFacts`, `Hardware`, `RoutingProfile`). Imports
only the planner's shared modules (errors, files, plan, units).
"""

"""Deciding: the layer graph, fused expert groups, the cost model and the placement walks that turn the inputs
into a `Plan` (every tensor's placement, the prefetch schedule, the prefill staging, the notes).

Takes the typed inputs (planner.inputs); gives a `Plan` (planner.plan). `build.build` wires the steps together.
"""

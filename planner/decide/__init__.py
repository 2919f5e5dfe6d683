"""Deciding: the cost model, the GPU footprint and the placement walks that turn the inputs into a `Plan`
(every tensor's placement, the prefetch schedule, the prefill staging, the notes a reviewer reads).

Takes the typed inputs (planner.inputs) and the layer structure (planner.layers); gives a `Plan`
(planner.plan). `build.build` wires the steps together.
"""

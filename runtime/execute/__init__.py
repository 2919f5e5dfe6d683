"""Executing: what runs while the model computes. The prefetch engine, uva staging, prefill staging and the
expert ring, offplan's experts implementation with its gather and lookahead, their custom ops, and the handle
that owns all of it until `remove()`.

Takes placed tensors (runtime.place); gives a model that runs per the plan, and its `OffloadHandle`.
"""

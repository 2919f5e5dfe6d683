"""Loading into place: checkpoint names mapped to the model's, the pinned arena and its zero-copy views, each
tensor's place read from the plan, and shard bytes copied straight there (quantized weights kept quantized); and
the class properties through which a staged layer's parameters read their GPU slots (slot_params.py, for prefill).

Takes a plan and a model built on the meta device; gives placed tensors. Imports nothing of runtime.execute.
"""

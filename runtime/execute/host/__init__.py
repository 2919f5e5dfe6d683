"""Experts on cpu: the host CPU computes the plan's cpu experts for the tokens routed to them, beside the GPU.

Takes the placed model, its arena (where the cpu experts' rows lie) and the plan; gives each experts module
with experts on cpu a `HostSlot` (its engine), through which experts.py hands the host its pairs.
`bind.py` checks and binds at load; `engine.py` is the engine (buffers, worker, the forward's two halves);
`kernel.py` the host's arithmetic; `handoff.py` how a CUDA stream wakes and awaits the engine's worker.
"""

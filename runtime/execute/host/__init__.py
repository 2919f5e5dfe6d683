"""Experts on cpu: the host CPU computes the plan's cpu experts for the tokens routed to them, beside the GPU.

Takes the placed model, its arena (where the cpu experts' rows lie) and the plan; gives each experts module
with experts on cpu a `HostSlot` (its engine), through which experts.py hands the host its pairs.
`bind.py` checks and binds at load; `engine.py` is the engine (buffers, worker, the forward's two halves);
`module.py` what it keeps of each module, and who computes it; `native.cpp` (bound by `native.py`) the host's
kernel for gated bf16 and block-scaled FP8 experts, `kernel.py` the Python worker's arithmetic for the others;
`handoff.py` how a CUDA stream wakes and awaits the engine's worker; `pace.py` the load's probe of the host.
"""

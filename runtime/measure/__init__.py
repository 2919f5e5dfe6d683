"""Measuring: `plan calibrate` (this machine's bandwidths and per-layer times, for the cost model) and the
routing recorder behind `plan profile` (which experts a workload routes to).

Takes a GPU, or a loaded model and prompts; gives a hardware profile or a routing profile (planner.inputs).
"""

"""What the benchmark scripts share: checkpoints in real shapes (checkpoints.py), the policies and plans they
compare (plans.py), prompts and decode loops (loops.py), routers made to route like trained ones (routers.py), and
moe.py's per-expert budgets (budgets.py). The scripts run with benchmarks/ on sys.path and import it as `harness`."""

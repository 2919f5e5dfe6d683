"""Kept as it ran, from probe/suite2.py at the checkout root (`python probe/suite2.py`). Run the GPU suite's 6 parts on the machine's GPUs, one part per GPU at a time (CUDA_VISIBLE_DEVICES), the
stamps to $OUT, each part's log to /tmp; print every summary and failure."""
import concurrent.futures as cf, os, queue, subprocess, sys, time
from pathlib import Path
OUT = Path(os.environ["OUT"])
N = 6
ORDER = [1, 5, 2, 4, 6, 3]  # longest first, by the last run (part 3, never finished, guessed short)
import torch
gpus = queue.Queue()
for g in range(torch.cuda.device_count()):
    gpus.put(g)
print("gpus", torch.cuda.device_count(), torch.cuda.get_device_name(), flush=True)


def part(k):
    g = gpus.get()
    t = time.time()
    d = Path(f"/tmp/suite/{k}")
    d.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(g))
    with open(d / "out.log", "w") as f:
        rc = subprocess.run([sys.executable, ".ci/gpu_record.py", "run", "--out", str(d), "--part", f"{k}/{N}"],
                            env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    gpus.put(g)
    stamp = d / f"gpu-run-{k}-of-{N}.json"
    if stamp.is_file():
        (OUT / stamp.name).write_bytes(stamp.read_bytes())
    lines = (d / "out.log").read_text().splitlines()
    bad = [l for l in lines if "FAILED" in l or "Error" in l[:40]]
    print(f"part {k} gpu {g} rc {rc} {time.time() - t:.0f}s: {lines[-1] if lines else ''}", flush=True)
    for l in bad[:15]:
        print("   ", l[:300], flush=True)
    return rc


with cf.ThreadPoolExecutor(max_workers=torch.cuda.device_count()) as ex:
    rcs = list(ex.map(part, ORDER))
print("rcs", rcs)

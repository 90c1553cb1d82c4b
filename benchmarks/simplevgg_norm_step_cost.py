"""Thread-CPU ms per DP step (bk, B=256 in chunks of 256) of simplevgg-16(1)-32(1)-64 plain vs with
weight standardisation (convs; convs and the hidden fc layer) / GroupNorm, 1 torch thread, interleaved."""
import time
import torch
from dpscale.models import build_model
from dpscale.privacy.clipping.engines import make_engine
from dpscale.rng import DPRandom
from dpscale.train.step import noisy_clipped_mean
torch.set_num_threads(1)
variants = {"plain": {}, "ws": {"weight_standardization": True}, "ws+fc": {"weight_standardization": True, "head_weight_standardization": True}, "gn8": {"norm_groups": 8}}
x = torch.rand(256, 1, 28, 28); y = torch.randint(0, 10, (256,))
setups = {}
for name, kw in variants.items():
    torch.manual_seed(0)
    m = build_model("simplevgg-16(1)-32(1)-64", 10, (1, 28, 28), "tanh", **kw)
    e, _ = make_engine("bk", 0.1, m)
    setups[name] = (m, e, DPRandom(0))
times = {n: [] for n in variants}
for r in range(32):
    for n, (m, e, g) in setups.items():
        t = time.thread_time()
        noisy_clipped_mean(e, m, [(x, y)], noise_std=0.2, expected_batch_size=256.0, noise_generator=g)
        if r >= 2:
            times[n].append(1000 * (time.thread_time() - t))
for n, v in times.items():
    v.sort(); print(f"{n:6s} median {v[len(v)//2]:.1f} ms  min {v[0]:.1f} ms")

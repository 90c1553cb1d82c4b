"""Per-step noise cost of dp.secure_noise: DPRandom vs SecureRandom (os.urandom), interleaved, median of 11.

    python benchmarks/secure_noise_cost.py
"""
import statistics
import time
from dpscale.rng import DPRandom, SecureRandom
sizes = {"papernot-cnn": 26010, "tramer-cifar-cnn": 550570, "wrn16-4": 2748890, "resnet18-gn": 11172170}
seeded, secure = DPRandom(1), SecureRandom()
print("| model | parameters | DPRandom (ms) | os.urandom (ms) | ratio |\n|---|---|---|---|---|")
for name, n in sizes.items():
    a, b = [], []
    for _ in range(11):
        t = time.perf_counter(); seeded.normal((n,)); a.append(time.perf_counter() - t)
        t = time.perf_counter(); secure.normal((n,)); b.append(time.perf_counter() - t)
    ma, mb = statistics.median(a) * 1e3, statistics.median(b) * 1e3
    print(f"| {name} | {n:,} | {ma:.1f} | {mb:.1f} | {mb / ma:.1f}x |")

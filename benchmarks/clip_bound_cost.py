"""Run: python benchmarks/clip_bound_cost.py (prints | model | engine | B | old ms | new ms | ratio |).

Interleaved, one process, thread-CPU clock, one torch thread: the engines' per-chunk time with
the clip bound's construction against the arithmetic it replaced (float32 factors, no slack,
float32 sums of squares in vmap)."""
import time
import torch

from dpscale.models import build_model, default_input_shape
from dpscale.privacy import make_engine
from dpscale.privacy.clipping import bounds as clipping, per_example
from dpscale.privacy.clipping.ghost import engine as ghost
from dpscale.privacy.clipping.per_example import trainable_params

torch.set_num_threads(1)
new_units = per_example.clip_units


def old_units(unit_sq_norms, max_grad_norm, group_of=None, *, zeros, unit_slack=None):
    norms = sum(unit_sq_norms.values(), zeros).sqrt()
    finite = torch.isfinite(norms)
    factors = torch.where(finite, (max_grad_norm / (norms + 1e-6)).clamp(max=1.0), torch.zeros_like(norms))
    return {u: factors for u in unit_sq_norms}, norms


def use(old):
    per_example.clip_units = old_units if old else new_units
    ghost.clip_units = old_units if old else new_units
    per_example.blocked_sq_norms = (lambda g: g.reshape(g.shape[0], -1).pow(2).sum(1)) if old else clipping.blocked_sq_norms


for name, engine_name, batch in [("papernot-cnn", "bk", 64), ("tramer-cifar-cnn", "bk", 32), ("vit-tiny", "bk", 16),
                                 ("papernot-cnn", "vmap", 64), ("tramer-cifar-cnn", "ghost", 32)]:
    torch.manual_seed(0)
    shape = default_input_shape(name)
    model = build_model(name, 10, shape)
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))
    engine = make_engine(engine_name, 1.0, model)[0]
    params = trainable_params(model)
    times = {False: [], True: []}
    for rep in range(12):
        for old in (rep % 2 == 0, rep % 2 == 1):
            use(old)
            t = time.thread_time()
            engine.per_example_clipped_sum(model, params, (x, y))
            times[old].append(time.thread_time() - t)
    use(False)
    med = {k: sorted(v[2:])[len(v[2:]) // 2] * 1000 for k, v in times.items()}
    print(f"| {name} | {engine_name} | {batch} | {med[True]:.1f} | {med[False]:.1f} | {med[False] / med[True]:.3f} |", flush=True)

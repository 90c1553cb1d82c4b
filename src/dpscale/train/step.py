"""One DP-SGD logical step, in data-flow order.

    logical batch (Poisson) -> physical chunks -> per-example clipped sums (engine)
    -> total clipped sum -> + N(0, (sigma C)^2) once -> / expected batch size B
    -> optimizer step

With P processes, each holds part of the logical batch: its clipped sum gets the noise on the
noise rank only, and one all-reduce (SUM) between the two gives every rank the same noisy sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from dpscale.privacy.noise import add_gaussian_noise
from dpscale.privacy.per_example import Batch, Params, PerExampleEngine, trainable_params
from dpscale.rng import DPRandom


@dataclass(frozen=True)
class StepStats:
    """Attributes:
    batch_size: examples actually in this logical batch.
    loss_sum: sum of per-example losses (before the update).
    clipped_fraction: share of examples whose gradient norm exceeded C.
    mean_grad_norm: mean per-example gradient norm before clipping.
    """

    batch_size: int
    loss_sum: float
    clipped_fraction: float
    mean_grad_norm: float


def physical_chunks(
    x: torch.Tensor, y: torch.Tensor, indices: torch.Tensor, max_physical_batch_size: int
) -> Iterable[Batch]:
    """Gather a logical batch chunk by chunk, so at most ``max_physical_batch_size``
    examples are materialised at once however large the logical batch (64k+) is."""
    for chunk in indices.split(max_physical_batch_size):
        yield x[chunk], y[chunk]


def augmented_chunks(
    chunks: Iterable[Batch],
    kind: str,
    views: int,
    generator: torch.Generator,
    value_range: tuple[float, float],
) -> Iterable[Batch]:
    """Each chunk's images as K augmented views (B, K, C, H, W), with per-view random
    parameters drawn from ``generator`` (checkpointed with the run, so a resumed run draws the
    same views)."""
    from dpscale.data.augment import augment_views

    for x, y in chunks:
        yield augment_views(x, kind, views, generator, value_range=value_range), y


def noisy_clipped_mean(
    engine: PerExampleEngine,
    model: nn.Module,
    chunks: Iterable[Batch],
    *,
    noise_std: float,
    expected_batch_size: float,
    noise_generator: DPRandom,
    all_reduce_sum: Callable[[list[torch.Tensor]], None] | None = None,
    add_noise: bool = True,
) -> tuple[Params, StepStats]:
    """The private gradient of one logical batch.

    Args:
        engine: per-example clipping engine (holds C).
        model: the model; its trainable parameters define the gradient.
        chunks: the logical batch as physical (x, y) chunks (possibly none: an empty batch).
        noise_std: sigma * C (0 for non-private runs).
        expected_batch_size: B; dividing by the *expected* size (not the realised one) keeps
            the sensitivity of the mean at C / B, as the accountant assumes.
        noise_generator: RNG for the noise (128-bit seeded; draws on the host, copied to the device).
        all_reduce_sum: in data-parallel training, sums a list of tensors over the ranks in place
            (``Distributed.all_reduce_sum_``); None for a single process.
        add_noise: whether this process draws the noise (exactly one rank does).

    Returns:
        (gradient by parameter name, step statistics of the whole logical batch).
    """
    params = trainable_params(model)
    total = {name: torch.zeros_like(p) for name, p in params.items()}
    loss_sum, norm_parts = 0.0, []
    for chunk in chunks:
        grad_sum, norms, losses = engine.clipped_sum_and_losses(model, params, chunk)
        for name in total:
            total[name] += grad_sum[name]
        loss_sum += float(losses.sum())
        norm_parts.append(norms)
    # once per logical step: on one rank, before the ranks' sums are added up
    noisy = add_gaussian_noise(total, noise_std if add_noise else 0.0, noise_generator)

    norms = torch.cat(norm_parts) if norm_parts else torch.zeros(0)
    clip = engine.max_grad_norm
    clipped = float((norms > clip).sum()) if clip is not None else 0.0
    # examples, loss sum, clipped examples, norm sum: of this rank's part, then of the whole batch
    device = next(iter(total.values())).device if total else norms.device  # nccl reduces on the GPU
    counts = torch.tensor(
        [float(norms.numel()), loss_sum, clipped, float(norms.sum())], dtype=torch.float64, device=device
    )
    if all_reduce_sum is not None:
        all_reduce_sum([noisy[name] for name in sorted(noisy)])
        all_reduce_sum([counts])
    gradient = {name: g / expected_batch_size for name, g in noisy.items()}

    examples = int(counts[0])
    stats = StepStats(
        batch_size=examples,
        loss_sum=float(counts[1]),
        clipped_fraction=float(counts[2]) / examples if examples else 0.0,
        mean_grad_norm=float(counts[3]) / examples if examples else 0.0,
    )
    return gradient, stats


def apply_gradient(model: nn.Module, gradient: Params, optimizer: torch.optim.Optimizer) -> None:
    """Write the private gradient into ``.grad`` and take one optimizer step."""
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.grad = gradient[name].to(p.dtype)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

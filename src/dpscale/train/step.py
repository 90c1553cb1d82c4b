"""One DP-SGD logical step, in data-flow order.

    logical batch (Poisson) -> physical chunks -> per-example clipped sums (engine)
    -> total clipped sum -> + N(0, (sigma C)^2) once -> / expected batch size B
    -> optimizer step

With P processes, each holds part of the logical batch: its clipped sum gets the noise on the
noise rank only, and one all-reduce (SUM) between the two gives every rank the same noisy sum.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from dpscale.privacy.noise.gaussian import draw_noise, with_scaled_noise
from dpscale.clip_norms import clip_sensitivity
from dpscale.privacy.clipping.per_example import (
    Batch,
    PerExampleEngine,
    pad_chunk,
    trainable_params,
)
from dpscale.privacy.noise.gaussian import Params
from dpscale.privacy.plan.dp_plan import DPPlan
from dpscale.rng import DPRandom


# One host thread draws a step's noise while the device computes its gradient (see noisy_clipped_mean).
_NOISE_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpscale-noise")


# The statistics a step accumulates, in the order of StepStats.counts (one device tensor: no host sync).
STEP_STATISTICS = ("examples", "loss_sum", "clipped", "grad_norm_sum", "nonfinite")


@dataclass(frozen=True)
class StepStats:
    """Statistics of one logical batch, kept where they were computed: reading a property waits
    for the device (a host sync), so a training loop reads them only when it reports.

    Attributes:
        counts: float64 tensor of the ``STEP_STATISTICS``: examples, sum of per-example losses
            (before the update), examples whose gradient norm exceeded C, sum of per-example
            gradient norms, examples whose gradient was not finite (every precision: they
            contributed zero). Read it by name with ``select``.
    """

    counts: torch.Tensor

    def select(self, *names: str) -> torch.Tensor:
        """The named statistics as a tensor on the device, in the order given (no host sync: an
        index list would be copied to the device first, which waits for it)."""
        return torch.stack([self.counts[STEP_STATISTICS.index(name)] for name in names])

    def _value(self, name: str) -> float:
        return float(self.counts[STEP_STATISTICS.index(name)])

    @property
    def examples(self) -> int:
        """Examples actually in this logical batch (the realised count; the plan's batch_size is the expected B)."""
        return int(self._value("examples"))

    @property
    def loss_sum(self) -> float:
        return self._value("loss_sum")

    @property
    def clipped(self) -> int:
        """Examples whose gradient norm exceeded C (or was not finite)."""
        return int(self._value("clipped"))

    @property
    def clipped_fraction(self) -> float:
        """Share of examples whose gradient norm exceeded C."""
        return self._value("clipped") / self.examples if self.examples else 0.0

    @property
    def mean_grad_norm(self) -> float:
        """Mean per-example gradient norm before clipping."""
        return self._value("grad_norm_sum") / self.examples if self.examples else 0.0

    @property
    def nonfinite_examples(self) -> int:
        """Examples whose gradient was not finite (an overflow, a NaN in their own data): they
        contributed exactly zero, in every precision."""
        return int(self._value("nonfinite"))

    def as_dict(self) -> dict[str, float]:
        """All the statistics (one host sync)."""
        names = ("examples", "loss_sum", "clipped_fraction", "mean_grad_norm", "nonfinite_examples")
        on_host = StepStats(self.counts.cpu())
        return {name: getattr(on_host, name) for name in names}


def physical_chunks(
    x: torch.Tensor, y: torch.Tensor, indices: torch.Tensor, max_physical_batch_size: int
) -> Iterable[Batch]:
    """Gather a logical batch chunk by chunk, so at most ``max_physical_batch_size``
    examples are materialised at once however large the logical batch (64k+) is."""
    for chunk in indices.split(max_physical_batch_size):
        yield x[chunk], y[chunk]


def padded_chunks(chunks: Iterable[Batch], rows: int | None) -> Iterable[Batch]:
    """Each chunk padded with zero rows to ``rows`` (``pad_chunk``: the padding weighs exactly
    nothing), so that every chunk of every step has one shape; ``chunks`` as they are for None."""
    return chunks if rows is None else (pad_chunk(chunk, rows) for chunk in chunks)


def pad_rows_for(plan: DPPlan, max_physical_batch_size: int | None) -> int:
    """The rows every chunk is padded to for fixed shapes: the chunk size, or a logical batch's
    largest size when smaller (the cap of truncated Poisson, a fixed-size batch).

    Raises:
        ValueError: uncapped Poisson without a chunk size (its batches have no largest size), or
            the user unit (its chunks hold whole users; not padded yet), in one line.
    """
    if plan.user_level:
        raise ValueError(
            "fixed_shapes pads chunks of examples; at privacy_unit='user' chunks hold whole users: not yet"
        )
    bounds = [n for n in (max_physical_batch_size, plan.max_batch_size) if n is not None]
    if plan.sampling in ("fixed", "shuffle"):
        bounds.append(round(plan.batch_size))
    if not bounds:
        raise ValueError(
            "fixed_shapes pads every chunk to one size, and uncapped Poisson batches have no largest size: give "
            "max_physical_batch_size (the chunk) or max_batch_size (the cap of truncated Poisson)"
        )
    return int(min(bounds))


def fixed_rows(
    plan: DPPlan, max_physical_batch_size: int | None, fixed_shapes: bool | None, compiled: bool
) -> int | None:
    """The rows chunks are padded to (``pad_rows_for``), or None when they are not: ``fixed_shapes``
    True pads (or refuses why it cannot), False does not, None pads a compiled step's chunks where
    the sampling has a largest batch."""
    if fixed_shapes is False or (fixed_shapes is None and not compiled):
        return None
    try:
        return pad_rows_for(plan, max_physical_batch_size)
    except ValueError:
        if fixed_shapes:
            raise
        return None


def augmented_chunks(
    chunks: Iterable[Batch],
    kind: str,
    views: int,
    generator: torch.Generator,
    value_range: tuple[float, float],
    padding: int = 4,
) -> Iterable[Batch]:
    """Each chunk's images as K augmented views (B, K, C, H, W), with per-view random
    parameters drawn from ``generator`` (checkpointed with the run, so a resumed run draws the
    same views); ``padding``: crop-flip's and crop's largest shift, px."""
    from dpscale.data.augment import augment_views

    for x, y in chunks:
        yield augment_views(x, kind, views, generator, value_range=value_range, padding=padding), y


@dataclass(frozen=True)
class AugmentViews:
    """AugMult's K augmented views of each example (K = 1: the images as they are), drawn from
    the run's augmentation generator in chunk order."""

    kind: str
    views: int
    generator: torch.Generator
    value_range: tuple[float, float]
    padding: int = 4  # crop-flip's and crop's largest shift, px (augment.padding)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """(n, C, H, W) images -> (n, K, C, H, W) views."""
        from dpscale.data.augment import augment_views

        return augment_views(
            x,
            self.kind,
            self.views,
            self.generator,
            value_range=self.value_range,
            padding=self.padding,
        )

    def chunks(self, chunks: Iterable[Batch]) -> Iterable[Batch]:
        """Each (x, y) chunk with x as its K views (the chunks unchanged when K = 1)."""
        if self.views == 1:
            return chunks
        return augmented_chunks(
            chunks, self.kind, self.views, self.generator, self.value_range, self.padding
        )


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
    prefetch_noise: bool | None = None,
    correlate: Callable[[Params], Params] | None = None,
) -> tuple[Params, StepStats]:
    """The private gradient of one logical batch.

    Args:
        engine: per-example clipping engine (holds C).
        model: the model; its trainable parameters define the gradient.
        chunks: the logical batch as physical (x, y) chunks (possibly none: an empty batch).
        noise_std: sigma * C, or sigma * sqrt(sum_g C_g^2) per layer (0 for non-private runs).
        expected_batch_size: B; dividing by the *expected* size (not the realised one) keeps
            the sensitivity of the mean at C / B, as the accountant assumes.
        noise_generator: RNG for the noise (128-bit seeded; draws on the host, copied to the device).
        all_reduce_sum: in data-parallel training, sums a list of tensors over the ranks in place
            (``Distributed.all_reduce_sum_``); None for a single process.
        add_noise: whether this process draws the noise (exactly one rank does).
        prefetch_noise: draw the noise on a host thread while the chunks' gradients are computed
            (the same values, in the same order: the noise never depends on the gradient).
            None: on a GPU only, where the host is otherwise idle while the device works.
        correlate: BandMF: turns this step's standard normals z_t into its correlated noise
            (C_s^{-1} Z)_t (``BandedNoise.next``; called once per step, on the noise rank only);
            None: independent noise (DP-SGD).

    Returns:
        (gradient by parameter name, step statistics of the whole logical batch).
    """
    params = trainable_params(model)
    names = sorted(params)
    # the StepStats counts, accumulated on the device: no host sync
    # nccl reduces on the GPU
    device = next(iter(params.values())).device if params else torch.device("cpu")
    counts = torch.zeros(len(STEP_STATISTICS), dtype=torch.float64, device=device)
    std = noise_std if add_noise else 0.0
    if prefetch_noise is None:
        prefetch_noise = device.type == "cuda"
    pending = (
        _NOISE_THREAD.submit(draw_noise, params, noise_generator)
        if std > 0 and prefetch_noise
        else None
    )
    # the clipped sums in sorted-name order, in the parameters' types
    total: list[torch.Tensor] | None = None
    for i, chunk in enumerate(chunks):
        # the first chunk's own tensors, copied (one operator) before the engine
        if i == 1 and total is not None:
            # runs again: it may reuse them for its next output
            total = list(torch._foreach_mul(total, 1.0))
        total, chunk_counts = _add_chunk(engine, model, params, chunk, total, names)
        counts += chunk_counts if chunk_counts.device == device else chunk_counts.to(device)
    if total is None:  # an empty logical batch: the noise alone
        total = [torch.zeros_like(params[name]) for name in names]
    # once per logical step: on one rank, before the ranks' sums are added up
    noise = pending.result() if pending else None
    if std > 0 and correlate is not None:
        noise = correlate(noise if noise is not None else draw_noise(params, noise_generator))
    if std > 0:
        noise = noise if noise is not None else draw_noise(params, noise_generator)
        total = with_scaled_noise(total, std, [noise[name] for name in names])
    # the reduce writes in place: never into an engine's own tensors
    elif all_reduce_sum is not None:
        total = [t.clone() for t in total]
    if all_reduce_sum is not None:  # this rank's part, then the whole batch's
        all_reduce_sum(total)
        all_reduce_sum([counts])
    return dict(zip(names, torch._foreach_div(total, expected_batch_size))), StepStats(counts)


def _add_chunk(
    engine: PerExampleEngine,
    model: nn.Module,
    params: Params,
    chunk: Batch,
    total: list[torch.Tensor] | None,
    names: list[str],
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Add one physical chunk's clipped per-example gradient sum into ``total``.

    Args:
        total: the sums so far in ``names`` order, or None before the first chunk, whose sums (the
            engine's own tensors) become the total.

    Returns:
        (the total, the chunk's ``STEP_STATISTICS`` (float64, on the chunk's device)).

    Every operation makes new tensors (out of place, one multi-tensor operator each): an engine's
    returned tensors are read, never written, even one that reuses its output buffers.
    """
    grad_sum, norms, losses = engine.clipped_sum_and_losses(model, params, chunk)
    sums = [grad_sum[name] for name in names]
    if total is None:  # 0 + s is s: the first chunk's sums, taken to the parameters' types
        total = [
            s if s.dtype == params[n].dtype else s.to(params[n].dtype) for n, s in zip(names, sums)
        ]
    else:
        total = list(torch._foreach_add(total, sums))
    return total, _chunk_statistics(engine, norms, losses)


def _chunk_statistics(
    engine: PerExampleEngine, norms: torch.Tensor, losses: torch.Tensor
) -> torch.Tensor:
    """A chunk's ``STEP_STATISTICS`` (float64, on the chunk's device), in a few operators."""
    # per layer: examples whose whole norm exceeds sqrt(sum_g C_g^2), which were clipped in some
    # group (a lower bound on those clipped anywhere)
    clip = clip_sensitivity(engine.max_grad_norm)
    finite = torch.isfinite(norms)
    # a non-finite norm counts as clipped (it contributed zero): adaptive clipping's count needs
    # every example's indicator in {0, 1}; a non-finite example's loss stays out of the train loss
    clipped = torch.where(norms <= clip, 0.0, 1.0) if clip is not None else torch.zeros_like(norms)
    rows = torch.stack(
        [
            torch.ones_like(norms),
            torch.where(finite, losses, 0.0),
            clipped,
            torch.where(finite, norms, 0.0),
            torch.where(finite, 0.0, 1.0),
        ]
    )
    return rows.sum(1, dtype=torch.float64)


def apply_gradient(model: nn.Module, gradient: Params, optimizer: torch.optim.Optimizer) -> None:
    """Write the private gradient into ``.grad`` and take one optimizer step."""
    for name, p in model.named_parameters():
        if p.requires_grad:
            g = gradient[name]
            p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

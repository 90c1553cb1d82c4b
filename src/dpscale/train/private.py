"""``dpscale.make_private``: the one entry point for a user's own model, optimizer and loop.

It checks the typed options (``dpscale.privacy.options``), then builds the DP plan (calibrating sigma
when given a target epsilon), picks and checks the clipping engine, and returns the
:class:`~dpscale.train.mechanism.DPMechanism` that takes every step (``dpscale.train.private_build``,
imported on the call: ``import dpscale; dpscale.make_private`` stays light). See the mechanism's
module for the loop it expects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from dpscale.privacy.options import (
    AccountantName,
    Budget,
    Clipping,
    Noise,
    PerformanceFlags,
    Sampling,
    Unit,
    check_accountant,
)
from dpscale.train.private_options import typed_options

if TYPE_CHECKING:
    import torch
    from torch import nn

    from dpscale.privacy.clipping.per_example import Batch
    from dpscale.train.mechanism import DPMechanism


def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    dataset_size: int,
    sampling: Sampling | str | None = None,
    clipping: Clipping | str | None = None,
    budget: Budget | None = None,
    epochs: float | None = None,
    steps: int | None = None,
    noise: Noise | None = None,
    unit: Unit | None = None,
    accountant: AccountantName = "pld",
    performance: PerformanceFlags | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    augment_multiplicity: int = 1,
    scheduler: Any = None,
    seed: int | None = None,
    secure_noise: bool = False,
    check: bool = True,
    check_batch: Batch | None = None,
    **flat_keywords: Any,
) -> DPMechanism:
    """Make ``model``'s training with ``optimizer`` differentially private: DP-SGD (or BandMF's
    correlated noise) with the sampling, clipping and budget given as ``dpscale``'s typed options.

    Args:
        model, optimizer: the user's; the optimizer must hold the trainable parameters.
        dataset_size: N, the number of private training examples (at the user unit too).
        sampling: ``Poisson(batch_size=B, max_batch_size=None|M|"auto")`` (q = B / N; at the user
            unit B counts users), ``FixedSize(batch_size=B)`` or ``Shuffle(batch_size=B)`` (docs/sampling.md).
        clipping: ``Flat(max_grad_norm=C)``, ``PerLayer(bounds={"conv*": 0.5, "fc*": 1.0}, per="group"|"tensor")``,
            ``Adaptive(max_grad_norm=C0, quantile=0.5, ...)`` or ``Automatic(max_grad_norm=C, gamma=0.01)``
            (docs/clipping.md). The noise std on the clipped sum is sigma x C (sigma x sqrt(sum C^2) per layer).
        budget: ``TargetEpsilon(epsilon=, delta=)`` (sigma calibrated so the planned steps spend it) or
            ``NoiseMultiplier(sigma=, delta=)``.
        epochs, steps: the length of the plan (one of them).
        noise: ``Independent()`` (DP-SGD, default) or ``BandMF(bands=...)`` (``batches()`` then samples
            cyclically; docs/correlated_noise.md). BandMF's strategy is optimised for prefix sums with
            SGD's momentum at a constant rate: with a ``scheduler``, give its rates as
            ``BandMF(workload=Workload(steps=S, momentum=..., lr_multipliers=(...)))``.
        unit: ``PerExample()`` (default) or ``PerUser(user_ids=, max_examples_per_user=k)``: the guarantee
            protects a person; ``batches()``/``sample()`` give the drawn users' examples, each user's
            consecutive (docs/privacy-units.md).
        accountant: "pld" or "rdp" (fixed-size batches are composed with RDP, capped Poisson with PLD).
        performance: ``PerformanceFlags(engine=, precision=, max_physical_batch_size=, compile=,
            fixed_shapes=)``: how the steps run, never the guarantee ("auto" chunks need ``check_batch``;
            the mechanism's ``max_physical_batch_size`` holds the number: pass it when resuming).
        loss_fn: per-example loss (logits, targets) -> (B,); default cross-entropy.
        augment_multiplicity: K views per example: inputs shaped (B, K, ...), an example's loss the
            mean over its views, clipped once (TAN's AugMult).
        scheduler: a learning-rate scheduler stepped after every optimizer step.
        seed: fixes the sampling and noise streams (research only: anyone who knows it can replay
            them); None draws fresh 128-bit OS entropy.
        secure_noise: draw the noise from the OS CSPRNG (``dpscale.rng.SecureRandom``): never
            reproducible, and ``state_dict()`` holds no noise state.
        check: verify the model, the loss and the engine before anything is released (default): each
            example's loss and norm must not depend on the other examples, and the engine must match a
            per-example loop; False skips both, and the plan and every epsilon say the run is unchecked.
        check_batch: (x, y) examples to run the checks on now (the first step's chunk is still
            checked for batch independence).
        flat_keywords: the flat keywords of earlier releases (``batch_size=``, ``max_grad_norm=``,
            ``delta=``, ``target_epsilon=``, ``clip_quantile=``, ``engine=``, ...), translated into the
            typed options with a ``DeprecationWarning`` that shows the new call.

    Returns:
        The mechanism: ``batches()``, ``step(...)``, ``epsilon()``, ``state_dict()``.

    Raises:
        ValueError: an option out of range (its class and field named), a layer that mixes examples or
            cannot be clipped per example (BatchNorm, ...), patterns that leave a parameter unmatched;
            at the first step, a model or loss that mixes examples.
        TypeError: a setting missing, unknown, or given both typed and flat.
    """
    options = typed_options(sampling, clipping, budget, noise, unit, performance, flat_keywords)
    check_accountant(accountant)
    if (epochs is None) == (steps is None):
        raise ValueError("give exactly one of epochs= and steps=")
    # the engines, the accountant, torch: on the call
    from dpscale.train.private_build import build_mechanism

    return build_mechanism(
        model,
        optimizer,
        options,
        dataset_size=dataset_size,
        epochs=epochs,
        steps=steps,
        accountant=accountant,
        loss_fn=loss_fn,
        augment_multiplicity=augment_multiplicity,
        scheduler=scheduler,
        seed=seed,
        secure_noise=secure_noise,
        check=check,
        check_batch=check_batch,
    )

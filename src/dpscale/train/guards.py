"""What keeps a DP mechanism's steps its own: the model digest a state is tied to, the guard on
``optimizer.step()`` outside the mechanism, and the first chunk's batch-independence check."""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch
from torch import nn

from dpscale.clip_norms import MaxGradNorm, check_same_tensors
from dpscale.data.user_ids import UserIndex
from dpscale.privacy.plan.dp_plan import DPPlan
from dpscale.privacy.clipping.independence import check_batch_independence
from dpscale.privacy.clipping.per_example import Batch, PerExampleEngine


def model_digest(model: nn.Module) -> str:
    """SHA-256 of the model's trainable parameters (names, dtypes, shapes and values): ties a
    mechanism state to the weights its accountant covers."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        if p.requires_grad:
            value = p.detach().cpu().contiguous()
            digest.update(f"{name}:{value.dtype}:{tuple(value.shape)}".encode())
            digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# A check of (engine, model, first chunk) that returns the engine to train with, or raises ValueError.
FirstChunkCheck = Callable[[PerExampleEngine, nn.Module, Batch], PerExampleEngine]
STEP_OUTSIDE_THE_MECHANISM = (
    "optimizer.step() was called outside mechanism.step(...): that update would be neither clipped, noised nor "
    "accounted. Take every step with mechanism.step(x, y) (it steps the optimizer itself)"
)


def refuse_steps_outside_the_mechanism(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.step()`` raise unless the mechanism is taking its step (once per optimizer)."""
    if getattr(optimizer, "_dpscale_guarded", False):
        return

    def refuse(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if not getattr(opt, "_dpscale_in_step", False):
            raise RuntimeError(STEP_OUTSIDE_THE_MECHANISM)

    optimizer.register_step_pre_hook(refuse)
    optimizer._dpscale_guarded = True  # type: ignore[attr-defined]
    optimizer._dpscale_in_step = False  # type: ignore[attr-defined]


def independence_check(
    engine: PerExampleEngine, model: nn.Module, chunk: Batch
) -> PerExampleEngine:
    """The first training chunk's batch-independence check (``FirstChunkCheck``): ``engine`` if
    each example's loss and norm are its own, else ValueError naming what mixes examples."""
    result = check_batch_independence(engine, model, chunk)
    if result is not None and not result.ok:
        raise ValueError(f"on the first training batch: {result.describe()}")
    return engine


def check_optimizer_covers_trainable(
    model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: MaxGradNorm
) -> None:
    """Refuse to step when a trainable parameter of the model is not in the optimizer (a head
    replaced, or layers unfrozen, after the optimizer was made): it would be clipped and
    noised but never updated, a silent no-op. (Freezing later is fine: a frozen parameter gets
    no gradient, so the optimizer leaves it alone; not under per-tensor bounds, though.)

    Raises:
        ValueError: such a parameter, or per-tensor bounds that no longer name the trainable tensors.
    """
    check_same_tensors(max_grad_norm, [n for n, p in model.named_parameters() if p.requires_grad])
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = sorted(
        n for n, p in model.named_parameters() if p.requires_grad and id(p) not in optimized
    )
    if missing:
        raise ValueError(
            f"trainable parameters not in the optimizer: {', '.join(missing)} (a head replaced or layers "
            "unfrozen after the optimizer was made: they would never be updated). Replace the head or "
            "unfreeze before the run is built (model.freeze_groups in the config; in your own loop, make the "
            "optimizer and call make_private after the change)"
        )


def check_state_fits(
    state: dict[str, Any], plan: DPPlan, model: nn.Module, users: UserIndex | None
) -> DPPlan:
    """Check that a mechanism state (``DPMechanism.state_dict``) continues this mechanism's run:
    the same DP plan's numbers, the model's trainable weights it was saved with, the same users.

    Returns:
        the state's own plan (its caveats stay with the steps taken under it).

    Raises:
        ValueError: another plan, other weights (the accountant would not cover the steps that
            trained them), or another grouping of the examples into users.
    """
    saved = DPPlan(**state["plan"])
    if saved != plan:  # the numbers (labels are left out of ==)
        raise ValueError(
            "this mechanism state was written under a different DP plan; refusing to load it"
        )
    if state.get("model_digest", model_digest(model)) != model_digest(model):
        raise ValueError(
            "the model's trainable weights are not the ones saved with this mechanism state (its accountant "
            "would not cover the steps that trained them): load the model's weights from the same checkpoint "
            "first, then the mechanism's state"
        )
    if state.get("users") != (users.digest() if users is not None else None):
        raise ValueError(
            "this mechanism state was sampled from another grouping of the examples into users "
            "(user ids); continue it with the same user_ids"
        )
    return saved

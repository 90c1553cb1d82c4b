"""Canaries for the one-run audit: membership, the training set with them, the Dirac
gradient engine and the scores (see ``dpscale.audit``)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dpscale.audit import AUDIT_KINDS
from dpscale.config import ConfigError
from dpscale.data.datasets import ImageDataset
from dpscale.privacy.per_example import ClippedSumMixin, Params, PerExampleEngine, clip_factors, trainable_params
from dpscale.train.hooks import RunHooks

DIRAC_SCALE = 1000.0  # a gradient canary's norm, in units of C: clipping must cut it to C


class CanaryEngine(ClippedSumMixin):
    """Wraps a clipping engine: a placeholder row (label -1 - i) is canary i. An excluded canary
    contributes nothing (the noisy sum is then distributed exactly as without it, while N and q
    stay independent of membership); an included gradient canary contributes ``magnitude`` on its
    own coordinate, clipped by the inner engine's C.

    Args:
        inner: the run's checked engine (it clips the real examples).
        included: per canary, whether it is in the training set.
        coordinates: per canary, (parameter name, flat index), all distinct (gradient canaries);
            None for input canaries, whose included ones are ordinary examples.
        magnitude: a gradient canary's norm before clipping.
    """

    def __init__(
        self, inner: PerExampleEngine, included: np.ndarray, coordinates: Sequence[tuple[str, int]] | None = None,
        magnitude: float = 0.0,
    ) -> None:  # fmt: skip
        self.inner, self.magnitude = inner, float(magnitude)
        self.name = inner.name
        self.dirac = torch.from_numpy(np.asarray(included, dtype=bool) & (coordinates is not None))
        groups: dict[str, tuple[list[int], list[int]]] = {}
        for canary, (name, flat) in enumerate(coordinates or ()):
            groups.setdefault(name, ([], []))[0].append(canary)
            groups[name][1].append(flat)
        self.groups = {name: (torch.tensor(ids), torch.tensor(flats)) for name, (ids, flats) in groups.items()}
        # the real examples' clipped sum on the canary coordinates, this step (the auditor's side knowledge)
        self.data_sum = torch.zeros(len(self.dirac), dtype=torch.float64)

    @property
    def max_grad_norm(self) -> float | None:
        return self.inner.max_grad_norm

    def clipped_sum_and_losses(self, model: nn.Module, params: Params, batch: Any) -> tuple[Params, torch.Tensor, torch.Tensor]:
        x, y = batch
        is_canary = y < 0
        data = ~is_canary
        if bool(data.all()):
            grad_sum, norms, losses = self.inner.clipped_sum_and_losses(model, params, batch)
        elif bool(data.any()):
            grad_sum, norms, losses = self.inner.clipped_sum_and_losses(model, params, (x[data], y[data]))
        else:
            grad_sum, norms, losses = self.empty_result(params, x)
        if not self.groups:  # input canaries: excluded placeholders just drop out
            return grad_sum, norms, losses
        self.data_sum += self.at_coordinates(grad_sum)
        if not bool(is_canary.any()):
            return grad_sum, norms, losses
        ids = (-1 - y[is_canary]).cpu()
        # an included gradient canary's norm is the magnitude; an excluded one's gradient is zero
        canary_norms = torch.where(self.dirac[ids], self.magnitude, 0.0).to(norms.dtype).to(norms.device)
        values = torch.zeros(len(self.data_sum), dtype=torch.float64)
        values[ids] = (clip_factors(canary_norms, self.max_grad_norm) * canary_norms).double().cpu()
        grad_sum = dict(grad_sum)
        for name, (group_ids, flats) in self.groups.items():
            added = values[group_ids]
            if bool(added.any()):
                flat = grad_sum[name].reshape(-1).clone()
                flat[flats.to(flat.device)] += added.to(flat.device, flat.dtype)
                grad_sum[name] = flat.view_as(grad_sum[name])
        return grad_sum, torch.cat([norms, canary_norms]), torch.cat([losses, losses.new_zeros(len(ids))])

    def at_coordinates(self, tensors: Params) -> torch.Tensor:
        """The canaries' coordinates of ``tensors`` (by parameter name), as float64 on the CPU."""
        out = torch.zeros(len(self.data_sum), dtype=torch.float64)
        for name, (ids, flats) in self.groups.items():  # none for input canaries
            out[ids] = tensors[name].reshape(-1)[flats.to(tensors[name].device)].double().cpu()
        return out


class CanaryAudit:
    """The canaries of one audit and the hooks that put them into a run.

    Args:
        kind: "gradient" or "input".
        canaries: m.
        seed: draws membership (probability 1/2 each), the input canaries and their wrong labels,
            and the gradient canaries' coordinates.
    """

    def __init__(self, kind: str, canaries: int, seed: int) -> None:
        if kind not in AUDIT_KINDS:
            raise ConfigError(f"unknown audit kind {kind!r}; choose one of {', '.join(AUDIT_KINDS)}")
        if canaries < 2:
            raise ConfigError(f"an audit needs at least 2 canaries, got {canaries}")
        self.kind, self.m, self.seed = kind, int(canaries), int(seed)
        self.rng = np.random.Generator(np.random.PCG64DXSM(np.random.SeedSequence(self.seed)))
        self.included = self.rng.random(self.m) < 0.5
        self.engine: CanaryEngine | None = None
        self.llr = np.zeros(self.m)  # gradient canaries' scores, accumulated step by step
        self.plan: Any = None

    def hooks(self, fault: Any = None) -> RunHooks:
        """The run hooks that add the canaries (and ``fault``, for tests)."""
        return RunHooks(training_set=self._training_set, engine=lambda e, m: self._wrap(e, m, fault), observe_gradient=self._observe)

    # ------------------------------------------------------------- training set
    def _training_set(self, data: ImageDataset) -> ImageDataset:
        """All m canaries join the training set, so N (and q) do not depend on which are included:
        an excluded canary is a placeholder (label -1 - i) whose gradient is zero (CanaryEngine)."""
        n = len(data.y_train)
        device = data.y_train.device
        ids = torch.arange(self.m)
        placeholders = (-1 - ids).to(device, data.y_train.dtype)
        if self.kind == "input":
            if self.m > n // 2:
                raise ConfigError(f"--canaries {self.m}: input canaries are taken from the {n} training images; use at most {n // 2}")
            chosen = torch.from_numpy(self.rng.choice(n, size=self.m, replace=False))
            shift = torch.from_numpy(self.rng.integers(1, data.info.num_classes, size=self.m))
            self.images = data.x_train[chosen.to(data.x_train.device)]
            self.labels = (data.y_train[chosen.to(device)].cpu() + shift) % data.info.num_classes
            keep = torch.ones(n, dtype=torch.bool)
            keep[chosen] = False
            labels = torch.where(torch.from_numpy(self.included), self.labels, placeholders.cpu()).to(device)
            x = torch.cat([data.x_train[keep.to(data.x_train.device)], self.images])
            y = torch.cat([data.y_train[keep.to(device)], labels])
        else:
            x = torch.cat([data.x_train, data.x_train.new_zeros((self.m, *data.x_train.shape[1:]))])
            y = torch.cat([data.y_train, placeholders])
        return replace(data, x_train=x, y_train=y, info=replace(data.info, num_train=len(y)))

    # ------------------------------------------------------------------ engine
    def _wrap(self, engine: PerExampleEngine, model: nn.Module, fault: Any) -> PerExampleEngine:
        if fault is not None and fault.clip_scale != 1:
            engine = replace(engine, max_grad_norm=engine.max_grad_norm * fault.clip_scale)  # type: ignore[type-var]
        if self.kind == "input":
            self.initial_losses = self.canary_losses(model)
            self.engine = CanaryEngine(engine, self.included)  # drops the excluded placeholders
            return self.engine
        params = trainable_params(model)
        sizes = [(name, p.numel()) for name, p in sorted(params.items())]
        total = sum(size for _, size in sizes)
        if total < self.m:
            raise ConfigError(f"--canaries {self.m}: gradient canaries need distinct coordinates, and the model has {total} trainable")
        flat = np.sort(self.rng.choice(total, size=self.m, replace=False))
        self.rng.shuffle(flat)
        starts = np.cumsum([0] + [size for _, size in sizes])
        coordinates = []
        for index in flat:
            k = int(np.searchsorted(starts, index, side="right") - 1)
            coordinates.append((sizes[k][0], int(index - starts[k])))
        clip = self.max_grad_norm_of(engine, fault)
        self.engine = CanaryEngine(engine, self.included, coordinates, DIRAC_SCALE * clip)
        return self.engine

    @staticmethod
    def max_grad_norm_of(engine: PerExampleEngine, fault: Any) -> float:
        """C as the plan states it (a fault's looser clipping is hidden from everyone else)."""
        if engine.max_grad_norm is None:
            raise ConfigError("an audit needs clipping (dp.max_grad_norm): without it there is no claim to test")
        return engine.max_grad_norm / (fault.clip_scale if fault is not None else 1.0)

    # ---------------------------------------------------------------- scores
    def _observe(self, gradient: Params) -> None:
        """Score the gradient canaries on one released gradient: the residual r of canary i's
        coordinate (noisy sum minus the data's clipped sum, in units of C) is N(0, sigma^2) if
        absent and q N(1, sigma^2) + (1 - q) N(0, sigma^2) if included: add its log-likelihood ratio."""
        if self.engine is None or not self.engine.groups:  # input canaries are scored at the end
            return
        plan = self.plan
        clip = plan.max_grad_norm
        noisy_sum = self.engine.at_coordinates(gradient) * plan.batch_size
        residual = ((noisy_sum - self.engine.data_sum) / clip).numpy()
        self.engine.data_sum.zero_()
        sigma2 = plan.noise_multiplier**2
        q = plan.sample_rate
        self.llr += np.logaddexp(math.log1p(-q), math.log(q) + (residual - 0.5) / sigma2)

    def canary_losses(self, model: nn.Module) -> np.ndarray:
        """Each input canary's loss at its wrong label under ``model`` (no gradient)."""
        with torch.no_grad():
            losses = [
                F.cross_entropy(model(x), y.to(x.device), reduction="none").double().cpu()
                for x, y in zip(self.images.split(512), self.labels.split(512))
            ]
        return torch.cat(losses).numpy()

    def scores(self, model: nn.Module) -> np.ndarray:
        """One score per canary after training: higher means more likely included."""
        if self.kind == "input":
            return self.initial_losses - self.canary_losses(model)
        return self.llr.copy()

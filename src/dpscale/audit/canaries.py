"""Canaries for the one-run audit: membership, the training set with them, the Dirac
gradient engine and the scores (see ``dpscale.audit``)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dpscale.audit import AUDIT_KINDS
from dpscale.audit.dirac import DiracProbe, host_sizes
from dpscale.errors import ConfigError
from dpscale.data.image_dataset import ImageDataset
from dpscale.clip_norms import MaxGradNorm, is_per_layer
from dpscale.privacy.clipping.per_example import (
    ClippedSumMixin,
    PerExampleEngine,
    pad_chunk,
    per_example_cross_entropy,
    real_rows,
    trainable_params,
)
from dpscale.privacy.noise.gaussian import Params
from dpscale.privacy.clipping.precision import Precision
from dpscale.train.hooks import RunHooks

DIRAC_SCALE = 1000.0  # a gradient canary's norm, in units of C: clipping must cut it to C
# In fp16 a canary's gradient times the loss scale S must stay finite (fp16's largest is 65504):
# M S <= 2^15 (an overflowing canary would contribute zero, as if it were absent).
FP16_CANARY_LIMIT = 2.0**15


def dirac_norm(engine: PerExampleEngine, clip: float) -> float:
    """M, a gradient canary's norm before clipping: ``DIRAC_SCALE`` C, or less in fp16 (its loss
    scale S times M must stay finite). A clipping bug shows up to a looseness of M / C.

    Args:
        engine: the engine that will clip the canaries (its ``precision``, if any).
        clip: C.

    Returns:
        M; ConfigError when fp16 leaves no room above 2 C.
    """
    norm = DIRAC_SCALE * clip
    precision = getattr(engine, "precision", None)
    if precision is not None and precision.name == "fp16":
        norm = min(norm, FP16_CANARY_LIMIT / precision.loss_scale)
        if norm < 2 * clip:
            raise ConfigError(
                f"gradient canaries in fp16 with train.fp16_loss_scale={precision.loss_scale:g} can be at most "
                f"{norm / clip:.3g} C before clipping (they must exceed C well); lower the loss scale or use bf16"
            )
    return norm


class CanaryEngine(ClippedSumMixin):
    """Wraps a clipping engine: a placeholder row (label -1 - i) is canary i. An excluded canary
    contributes nothing (the noisy sum is then distributed exactly as without it, while N and q
    stay independent of membership). An included gradient canary is an example of the Dirac probe
    (``dpscale.audit.dirac``) that the inner engine itself differentiates, norms, clips and sums:
    its gradient is ``magnitude`` on its own coordinate, and its share of the released sum is
    whatever the engine makes of that (C if the engine clips correctly).

    Args:
        inner: the run's checked engine (it clips the real examples and the canaries).
        included: per canary, whether it is in the training set.
        coordinates: per canary, (parameter name, flat index), all distinct, each on a parameter
            ``host_sizes`` lists (gradient canaries); None for input canaries, whose included ones
            are ordinary examples.
        magnitude: a gradient canary's norm before clipping.
        model: the training model, to place the canaries at once (else at the first call).
    """

    @property
    def precision(self) -> Precision:
        """The inner engine's precision (the mechanism sets its matmul flags around each step)."""
        return self.inner.precision

    def __init__(
        self,
        inner: PerExampleEngine,
        included: np.ndarray,
        coordinates: Sequence[tuple[str, int]] | None = None,
        magnitude: float = 0.0,
        model: nn.Module | None = None,
    ) -> None:
        self.inner, self.magnitude = inner, float(magnitude)
        self.coordinates = list(coordinates or ())
        self.dirac = torch.from_numpy(np.asarray(included, dtype=bool) & (coordinates is not None))
        groups: dict[str, tuple[list[int], list[int]]] = {}
        for canary, (name, flat) in enumerate(self.coordinates):
            groups.setdefault(name, ([], []))[0].append(canary)
            groups[name][1].append(flat)
        self.groups = {
            name: (torch.tensor(ids), torch.tensor(flats)) for name, (ids, flats) in groups.items()
        }
        # the real examples' clipped sum on the canary coordinates, this step (the auditor's side knowledge)
        self.data_sum = torch.zeros(len(self.dirac), dtype=torch.float64)
        # the canaries' examples, for ``model`` (else for the model of the first call)
        self.probe = (
            DiracProbe(model, self.coordinates, self.magnitude)
            if model is not None and self.groups
            else None
        )

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def max_grad_norm(self) -> MaxGradNorm:
        return self.inner.max_grad_norm

    @property
    def clip_gamma(self) -> float | None:
        """The inner engine's automatic-clipping gamma (None: it clips to C)."""
        return self.inner.clip_gamma

    def clipped_sum_and_losses(
        self, model: nn.Module, params: Params, batch: Any
    ) -> tuple[Params, torch.Tensor, torch.Tensor]:
        x, y = batch
        rows, size = real_rows(batch), x.shape[0]
        if rows is not None:  # a fixed-shape chunk: its padding is neither data nor a canary
            x, y = x[:rows], y[:rows]
        is_canary = y < 0
        data = ~is_canary
        if bool(data.all()):
            grad_sum, norms, losses = self.inner.clipped_sum_and_losses(model, params, batch)
        # the data rows, padded again to the chunk's fixed size when it had one
        elif bool(data.any()):
            kept = (x[data], y[data])
            grad_sum, norms, losses = self.inner.clipped_sum_and_losses(
                model, params, kept if rows is None else pad_chunk(kept, size)
            )
        else:
            grad_sum, norms, losses = self.empty_result(params, x)
        if not self.groups:  # input canaries: excluded placeholders just drop out
            return grad_sum, norms, losses
        self.data_sum += self.at_coordinates(grad_sum)
        if not bool(is_canary.any()):
            return grad_sum, norms, losses
        ids = (-1 - y[is_canary]).cpu()
        # an excluded canary's gradient is zero: it never reaches the engine
        present = self.dirac[ids]
        canary_norms = norms.new_zeros(len(ids))
        if bool(present.any()):
            canary_sum, sampled_norms = self.canary_sum(model, params, ids[present])
            grad_sum = {name: g + canary_sum[name] for name, g in grad_sum.items()}
            canary_norms[present.to(norms.device)] = sampled_norms.to(norms.dtype)
        return (
            grad_sum,
            torch.cat([norms, canary_norms]),
            torch.cat([losses, losses.new_zeros(len(ids))]),
        )

    def canary_sum(
        self, model: nn.Module, params: Params, canaries: torch.Tensor
    ) -> tuple[Params, torch.Tensor]:
        """The inner engine's clipped sum and norms of the Dirac probe's examples for ``canaries``.

        Args:
            model: the training model (the probe holds it).
            params: its trainable parameters by name.
            canaries: ids of included canaries, all sampled in this chunk.

        Returns:
            (clipped sum under the model's names, per-canary norms the engine measured).
        """
        if self.probe is None or self.probe.net is not model:
            self.probe = DiracProbe(model, self.coordinates, self.magnitude)
        like = params[self.coordinates[0][0]]
        chunk = self.probe.batch(canaries, getattr(self.inner, "views", 1), like)
        grad_sum, norms, _ = self.inner.clipped_sum_and_losses(
            self.probe, self.probe.params(params), chunk
        )
        return self.probe.model_names(grad_sum), norms

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
            raise ConfigError(
                f"unknown audit kind {kind!r}; choose one of {', '.join(AUDIT_KINDS)}"
            )
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
        return RunHooks(
            training_set=self._training_set,
            engine=lambda e, m: self._wrap(e, m, fault),
            observe_gradient=self._observe,
        )

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
                raise ConfigError(
                    f"--canaries {self.m}: input canaries are taken from the {n} training images; use at most {n // 2}"
                )
            chosen = torch.from_numpy(self.rng.choice(n, size=self.m, replace=False))
            shift = torch.from_numpy(self.rng.integers(1, data.info.num_classes, size=self.m))
            self.images = data.x_train[chosen.to(data.x_train.device)]
            self.labels = (data.y_train[chosen.to(device)].cpu() + shift) % data.info.num_classes
            keep = torch.ones(n, dtype=torch.bool)
            keep[chosen] = False
            labels = torch.where(
                torch.from_numpy(self.included), self.labels, placeholders.cpu()
            ).to(device)
            x = torch.cat([data.x_train[keep.to(data.x_train.device)], self.images])
            y = torch.cat([data.y_train[keep.to(device)], labels])
        else:
            x = torch.cat([data.x_train, data.x_train.new_zeros((self.m, *data.x_train.shape[1:]))])
            y = torch.cat([data.y_train, placeholders])
        return replace(data, x_train=x, y_train=y, info=replace(data.info, num_train=len(y)))

    # ------------------------------------------------------------------ engine
    def _wrap(self, engine: PerExampleEngine, model: nn.Module, fault: Any) -> PerExampleEngine:
        clip = self.max_grad_norm_of(engine)
        # a broken engine (tests): the canaries go through it like everything else
        if fault is not None:
            engine = fault.apply(engine)
        if self.kind == "input":
            self.initial_losses = self.canary_losses(model)
            self.engine = CanaryEngine(engine, self.included)  # drops the excluded placeholders
            return self.engine
        if getattr(engine, "loss_fn", per_example_cross_entropy) is not per_example_cross_entropy:
            raise ConfigError(
                "gradient canaries need the engine's cross-entropy loss (their gradient is built for it)"
            )
        norm = dirac_norm(engine, clip)
        self.engine = CanaryEngine(
            engine, self.included, self._draw_coordinates(model), norm, model=model
        )
        return self.engine

    def _draw_coordinates(self, model: nn.Module) -> list[tuple[str, int]]:
        """m distinct coordinates, uniformly over the trainable Linear/Conv weights and biases
        (those a Dirac probe can give a gradient on one coordinate: ``dpscale.audit.dirac``)."""
        sizes = host_sizes(model, trainable_params(model))
        total = sum(size for _, size in sizes)
        if total < self.m:
            raise ConfigError(
                f"--canaries {self.m}: gradient canaries need distinct coordinates of trainable Linear/Conv layers, "
                f"and the model has {total}"
            )
        flat = np.sort(self.rng.choice(total, size=self.m, replace=False))
        self.rng.shuffle(flat)
        starts = np.cumsum([0] + [size for _, size in sizes])
        coordinates = []
        for index in flat:
            k = int(np.searchsorted(starts, index, side="right") - 1)
            coordinates.append((sizes[k][0], int(index - starts[k])))
        return coordinates

    def on_real_examples(
        self, check: Callable[[Any, nn.Module, Any], Any]
    ) -> Callable[[Any, nn.Module, Any], Any]:
        """A first-chunk check (engine, model, chunk) -> engine, run with the wrapped engine on the
        chunk's real examples: canary rows are no input of the model (placeholder labels -1 - i,
        Dirac probe rows), so a check of how the model treats a batch must not see them.

        Args:
            check: the mechanism's ``first_chunk_check``.

        Returns:
            the check for the canary engine; the engine it chooses is wrapped in place.
        """

        def on_real(engine: Any, model: nn.Module, chunk: Any) -> Any:
            if not isinstance(engine, CanaryEngine):
                return check(engine, model, chunk)
            x, y = chunk
            real = y >= 0
            # the check may choose another engine
            engine.inner = check(engine.inner, model, (x[real], y[real]))
            return engine

        return on_real

    @staticmethod
    def max_grad_norm_of(engine: PerExampleEngine) -> float:
        """C as the plan states it (and as a broken engine still reports it)."""
        if engine.max_grad_norm is None:
            raise ConfigError(
                "an audit needs clipping (dp.max_grad_norm): without it there is no claim to test"
            )
        if is_per_layer(engine.max_grad_norm):
            raise ConfigError(
                "an audit's canaries are scaled to one clipping norm C: per-layer dp.max_grad_norm is not supported"
            )
        return engine.max_grad_norm  # type: ignore[return-value]

    def scope(self) -> str:
        """One line: what the canaries put through the run's engine, and what they do not test."""
        if self.kind == "input":
            return (
                "input canaries: mislabelled images, ordinary examples of the whole model and engine; scored on the "
                "final model only (black box)"
            )
        if self.engine is None or self.engine.probe is None:
            return "gradient canaries: not yet placed"
        return (
            f"gradient canaries: Dirac examples (norm {self.engine.magnitude / self.max_grad_norm_of(self.engine):.4g} C "
            f"on one coordinate each) that the "
            f"{self.engine.name} engine itself differentiates, norms, clips and sums, each through one layer called "
            f"alone on a crafted input ({self.engine.probe.describe()}); not exercised by them: the engine's rules "
            "for other layer types and for the real examples' input shapes, and the model's full forward pass "
            "(the engine self-check compares those with a reference)"
        )

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

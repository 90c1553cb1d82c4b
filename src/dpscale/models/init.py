"""Starting a model from public weights (``model.init``): a run directory, a checkpoint or
state-dict file, or ``timm:<name>`` where timm imports.

Tensors are matched by name and shape; with ``reset_head`` the logits layer keeps its fresh
initialisation (a new number of classes). Anything else that does not match is refused with the
list. A source that is a dpscale run directory is checked by :func:`init_privacy`: trained on this
run's training data (same data fingerprint), its whole accounting history is composed into this
run's DP plan ("init-run:*"), or, trained without noise, refused unless ``model.init_public``
declares it public. Any other source (a weights file, ``timm:<name>``) is assumed public, and
every output says so.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from dpscale._io import load_checkpoint
from dpscale.errors import ConfigError
from dpscale.features.source_run import source_run_privacy
from dpscale.models.adapt import block_groups_of
from dpscale.privacy.accounting.segments import AccountingSegment
from dpscale.privacy.plan.source_runs import SourceRunPrivacy
from dpscale.runs import CHECKPOINT_NAME, is_run_dir


@dataclass(frozen=True)
class InitReport:
    """What ``init_from`` loaded: the source, a fingerprint of the loaded tensors, the counts."""

    source: str
    fingerprint: str
    loaded: int
    reset_head: tuple[str, ...]

    def describe(self) -> str:
        head = f"; head re-initialised ({', '.join(self.reset_head)})" if self.reset_head else ""
        return f"model.init: {self.loaded} tensors from {self.source} (sha256 {self.fingerprint[:12]}){head}"


def read_weights(source: str) -> dict[str, torch.Tensor]:
    """The state dict ``source`` names: a run directory (its checkpoint), a dpscale checkpoint, a
    file holding a state dict (or {"model" | "state_dict": ...}), or ``timm:<name>``."""
    if source.startswith("timm:"):
        try:
            import timm  # optional; does not import on the CPU torch of CI
        except Exception as err:  # any import failure: say so
            raise ConfigError(
                f"model.init={source}: timm does not import here ({type(err).__name__}: {err})"
            ) from err
        return timm.create_model(source[len("timm:") :], pretrained=True).state_dict()
    path = Path(source)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    if not path.is_file():
        raise _no_source(source)
    try:
        state = load_checkpoint(path)
    except ValueError:  # not a dpscale checkpoint: a plain state dict file
        state = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("model", "state_dict"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"model.init={source}: {path} holds no state dict of tensors")
    return state


def _no_source(source: str) -> ConfigError:
    return ConfigError(f"model.init={source}: no such run directory or weights file")


def _run_directory(source: str) -> Path | None:
    """The dpscale run directory ``source`` names (it, or its checkpoint.pt), else None."""
    path = Path(source).expanduser()
    run_dir = path if path.is_dir() else path.parent if path.name == CHECKPOINT_NAME else None
    return run_dir if run_dir is not None and is_run_dir(run_dir) else None


def init_privacy(
    model: Any, fingerprint_as: Callable[[bool], str], private: bool = True
) -> tuple[SourceRunPrivacy | None, tuple[AccountingSegment, ...]]:
    """How the source of ``model.init`` enters this run's guarantee, and the releases its run
    made that the DP plan must compose (see ``dpscale.features.extract.source_run_privacy``).

    Args:
        model: the run's model section (init, init_public).
        fingerprint_as: this run's training-set fingerprint as prepared with data.normalize set
            to the given flag.
        private: whether this run is private (only then is a non-private source refused).

    Returns:
        (None, ()) without model.init; ("assumed public", ()) for a source that is no dpscale run
        directory; else the run's case and the releases to compose (empty unless "composed").

    Raises:
        ConfigError: no such source; a run that cannot be read; or one that trained on this run's
            data without noise and is not declared public.
    """
    source = model.init
    if source is None:
        return None, ()
    run_dir = None if source.startswith("timm:") else _run_directory(source)
    if run_dir is None:
        if not source.startswith("timm:") and not Path(source).expanduser().is_file():
            raise _no_source(source)
        return SourceRunPrivacy(source, "assumed public", role="init"), ()
    return source_run_privacy("init", source, source, model.init_public, fingerprint_as, private)


def _head_names(model: nn.Module) -> set[str]:
    """Names of the logits layer's parameters (the last of ``block_groups()``)."""
    groups = block_groups_of(model)
    if groups is None:
        raise ConfigError(
            f"model.reset_head: {type(model).__name__} has no block_groups(), so no known head"
        )
    head = {id(p) for p in groups[-1]}
    return {name for name, p in model.named_parameters() if id(p) in head}


def _fingerprint(state: dict[str, torch.Tensor], names: list[str]) -> str:
    digest = hashlib.sha256()
    for name in names:
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def init_from(model: nn.Module, source: str, *, reset_head: bool = False) -> InitReport:
    """Load ``source``'s weights into ``model`` by name and shape (in place).

    Args:
        model: the freshly built model.
        source: see :func:`read_weights`.
        reset_head: keep the model's fresh logits layer (the source's head is ignored).

    Returns:
        What was loaded.

    Raises:
        ConfigError: listing every tensor missing from the source, of another shape, or in the
            source but not in the model.
    """
    state = read_weights(source)
    own = model.state_dict()
    head = _head_names(model) if reset_head else set()
    problems = [f"{n}: not in the source" for n in own if n not in head and n not in state]
    problems += [
        f"{n}: source {tuple(state[n].shape)} vs model {tuple(t.shape)}"
        for n, t in own.items()
        if n not in head and n in state and state[n].shape != t.shape
    ]
    problems += [
        f"{n}: in the source, not in the model" for n in state if n not in own and n not in head
    ]
    if problems:
        hint = "" if reset_head else " (a different number of classes? set model.reset_head: true)"
        raise ConfigError(
            f"model.init={source} does not match the model{hint}: " + "; ".join(problems)
        )
    names = [n for n in own if n not in head]
    with torch.no_grad():
        for name in names:
            own[name].copy_(state[name])
    return InitReport(source, _fingerprint(state, names), len(names), tuple(sorted(head)))


def meanvar_init(
    model: nn.Module, seed_state: dict[str, torch.Tensor], generator: torch.Generator
) -> dict[str, int]:
    """Mean-Var weight scaling (Raghu et al. 2019; Papernot et al. Section 4.2): every parameter
    tensor of ``model`` that the seed model has (by name) is redrawn i.i.d. from a Gaussian with
    the mean and variance of the seed's tensor of that name (shapes may differ, e.g. the head).

    Args:
        model: the freshly built model (changed in place).
        seed_state: the seed model's state dict.
        generator: the init generator (CPU).

    Returns:
        {"scaled": tensors redrawn, "kept": tensors the seed lacks (default init kept)}.
    """
    scaled = kept = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            source = seed_state.get(name)
            if source is None or not source.is_floating_point():
                kept += 1
                continue
            values = source.detach().double().cpu()
            mean, std = values.mean(), values.std(unbiased=False)
            draw = torch.randn(param.shape, generator=generator, dtype=torch.float64) * std + mean
            param.copy_(draw.to(param.dtype))
            scaled += 1
    return {"scaled": scaled, "kept": kept}

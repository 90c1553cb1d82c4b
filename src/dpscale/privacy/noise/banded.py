"""BandMF's online correlated noise: w = C^{-1} Z one step at a time, in the gradients' dtype and device.

The strategy C (its band c_0..c_{b-1}) comes from ``dpscale.privacy.noise.bandmf.optimize_strategy``.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Sequence

import torch

from dpscale.privacy.noise.bandmf_math import check_coefficients
from dpscale.privacy.noise.gaussian import Params

__all__ = ["BandedNoise"]


class BandedNoise:
    """Correlated noise w_t = (C^{-1} Z)_t generated online: w_t = (z_t - sum_{i=1}^{b-1}
    c_i w_{t-i}) / c_0, keeping only the last b-1 w's (O((b-1) x parameters) memory).

    The recursion runs in the noise's dtype on its device (float32 in training), with one
    multi-tensor kernel per band, always summed newest first, so that a run resumed from
    ``state_dict`` continues bit for bit. Scale the result by sigma * C_clip as DP-SGD's z.
    """

    def __init__(self, coefficients: Sequence[float]) -> None:
        """Args:
        coefficients: c_0..c_{b-1}, normalised (||c||_2 = 1 within 1e-9), c_0 > 0: the
            normalisation is what makes the noise private, so it is checked, not applied.
        """
        values = check_coefficients(coefficients)
        norm = math.sqrt(math.fsum(x * x for x in values))
        if abs(norm - 1.0) > 1e-9:
            raise ValueError(
                f"BandedNoise needs normalised coefficients (||c||_2 = 1), got norm {norm!r}"
            )
        self._coefficients = values
        # Newest first; a deque with maxlen drops w_{t-b+1} when w_t arrives.
        self._history: deque[Params] = deque(maxlen=len(values) - 1)

    @property
    def bands(self) -> int:
        """b, the number of coefficients."""
        return len(self._coefficients)

    @property
    def coefficients(self) -> tuple[float, ...]:
        """c_0..c_{b-1}."""
        return self._coefficients

    def next(self, z: Params) -> Params:
        """This step's correlated noise from this step's standard normals.

        Args:
            z: standard normal tensors by parameter name (same names and shapes every step).

        Returns:
            w_t by name, same dtype and device as z (unit variance scale: multiply by
            sigma * C_clip). For b = 1, z's own tensors. The tensors are the caller's to
            modify: the history keeps its own.
        """
        if self.bands == 1 or not z:
            return dict(z)  # c_0 == 1: w = z exactly, at no cost (and nothing to correlate)
        names = list(z)
        self._match_history(z)
        current = [z[name] for name in names]
        c0 = self._coefficients[0]
        if not self._history:
            noise = torch._foreach_div(current, c0)
        else:
            newest, *older = self._history
            noise = torch._foreach_mul([newest[name] for name in names], self._coefficients[1])
            for weight, past in zip(self._coefficients[2:], older):
                torch._foreach_add_(noise, [past[name] for name in names], alpha=weight)
            # (acc - z) / (-c0) is exactly (z - acc) / c0, computed in place.
            torch._foreach_sub_(noise, current)
            torch._foreach_div_(noise, -c0)
        self._history.appendleft(dict(zip(names, noise)))
        return {name: tensor.clone() for name, tensor in zip(names, noise)}

    def _match_history(self, z: Params) -> None:
        """Refuse a parameter set other than the history's; move the history to z's device and
        dtype where it is elsewhere (after load_state_dict, or a model moved between steps)."""
        if not self._history:
            return
        newest = self._history[0]
        if set(newest) != set(z):
            raise ValueError(
                f"BandedNoise: the parameter names changed (history has {sorted(newest)}, got {sorted(z)})"
            )
        for name, tensor in z.items():
            if newest[name].shape != tensor.shape:
                before, now = tuple(newest[name].shape), tuple(tensor.shape)
                raise ValueError(f"BandedNoise: {name} changed shape from {before} to {now}")
        moved = [
            n for n, t in z.items() if (newest[n].device, newest[n].dtype) != (t.device, t.dtype)
        ]
        if moved:
            for entry in self._history:
                for name in moved:
                    entry[name] = entry[name].to(device=z[name].device, dtype=z[name].dtype)

    def snapshot(self) -> tuple[Params, ...]:
        """The history as it stands (references: ``next`` never writes into a past entry), for
        ``rewind`` when a step is refused after its noise was made."""
        return tuple(self._history)

    def rewind(self, snapshot: tuple[Params, ...]) -> None:
        """Put the history back to ``snapshot`` (a step that was not released leaves no trace)."""
        self._history.clear()
        self._history.extend(snapshot)

    def memory_bytes(self, like: Params) -> int:
        """Bytes of the full history for parameters shaped like ``like``: (b-1) x their size."""
        return (self.bands - 1) * sum(t.numel() * t.element_size() for t in like.values())

    def state_dict(self) -> dict[str, Any]:
        """{"coefficients": [c_0, ...], "history": [w_{t-1}, w_{t-2}, ...]} (CPU copies)."""
        history = [
            {name: t.detach().to("cpu", copy=True) for name, t in entry.items()}
            for entry in self._history
        ]
        return {"coefficients": list(self._coefficients), "history": history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict``; the history moves to the noise's device at the next ``next``.

        Raises:
            ValueError: other coefficients (the noise would not be C^{-1} Z for one C), or a
                malformed history.
        """
        if not isinstance(state, dict) or "coefficients" not in state or "history" not in state:
            raise ValueError("BandedNoise state must be a dict with 'coefficients' and 'history'")
        try:
            theirs = tuple(float(x) for x in state["coefficients"])
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"BandedNoise state has unreadable coefficients {state['coefficients']!r}"
            ) from err
        if theirs != self._coefficients:
            raise ValueError(
                f"BandedNoise state was made with coefficients {theirs}, not {self._coefficients}"
            )
        history = state["history"]
        if not isinstance(history, (list, tuple)) or len(history) > self.bands - 1:
            raise ValueError(
                f"BandedNoise state history must be a list of at most {self.bands - 1} steps"
            )
        names = [set(entry) if isinstance(entry, dict) else None for entry in history]
        if any(n is None or n != names[0] for n in names):
            raise ValueError(
                "BandedNoise state history entries must be dicts with the same parameter names"
            )
        if not all(isinstance(t, torch.Tensor) for entry in history for t in entry.values()):
            raise ValueError("BandedNoise state history must hold tensors")
        self._history = deque((dict(entry) for entry in history), maxlen=self.bands - 1)

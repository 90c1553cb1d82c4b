"""The layers per-example clipping refuses (one list, checked before any engine runs) and the
parameter types it takes.

A layer that mixes examples (BatchNorm), writes private data into the model (``Embedding(max_norm=...)``)
or has no per-example gradient (torch's RNN/GRU/LSTM) would break the DP guarantee silently or fail
inside torch; ``check_per_example_compatible`` refuses it in one line, with the way out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


def _trainable(module: nn.Module) -> bool:
    """Whether the layer itself holds a parameter that DP-SGD updates."""
    return any(p.requires_grad for p in module.parameters(recurse=False))


@dataclass(frozen=True)
class LayerRefusal:
    """A layer configuration that per-example clipping refuses, and the way out.

    Attributes:
        layers: the layer types concerned (subclasses included).
        applies: whether a layer of those types is refused as configured.
        reason: what goes wrong with it (completes "layer 'name' (Type) ...").
        fix: the way out, for the user.
        engines: the engines that refuse it; None: every engine.
    """

    layers: tuple[type[nn.Module], ...]
    applies: Callable[[nn.Module], bool]
    reason: str
    fix: str
    engines: tuple[str, ...] | None = None


_NORM_FIX = "use GroupNorm/LayerNorm, e.g. dpscale.models.convert_batchnorm_to_groupnorm(model)"
_RECURRENT = (nn.RNNBase, nn.RNNCellBase)  # RNN/GRU/LSTM and their cells
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)

# The one list of layers that per-example clipping refuses, checked before any engine runs (the
# alternative is a torch-internal error, or a silently wrong guarantee). Measured on torch 2.x:
# vmap cannot batch torch's fused recurrent kernels (their state is written in place; LSTM runs
# only on CPU float32's mkldnn kernel, so it is refused too rather than depend on the CPU), and
# bk/ghost have no rule for their parameters, but run a frozen one as it is.
REFUSED_LAYERS: tuple[LayerRefusal, ...] = (
    LayerRefusal(
        (nn.modules.batchnorm._BatchNorm,),
        lambda m: True,
        "mixes examples within a batch, so per-example gradients (and the DP guarantee) break",
        _NORM_FIX,
    ),
    LayerRefusal(
        (nn.modules.instancenorm._InstanceNorm,),
        lambda m: bool(m.track_running_stats),
        "keeps running statistics of the private batch (updated without noise)",
        f"set track_running_stats=False, or {_NORM_FIX}",
    ),
    LayerRefusal(
        _RECURRENT,
        _trainable,
        "has no exact per-example gradient in any engine (torch's fused recurrent kernel)",
        "write the recurrence with nn.Linear layers applied at each time step and use engine=vmap, or freeze "
        "the layer (requires_grad_(False)) and use engine=bk",
    ),
    LayerRefusal(
        _RECURRENT,
        lambda m: True,
        "cannot run inside the vmap engine (torch's fused recurrent kernel writes its state in place)",
        "use engine=bk or ghost, which run a frozen recurrent layer as it is",
        engines=("vmap",),
    ),
    LayerRefusal(
        _EMBEDDINGS,
        lambda m: m.max_norm is not None,
        "renormalises its weight in place during the forward pass (a write to the model that depends on "
        "the private batch and is never noised)",
        "set max_norm=None (renormalise the weight after each optimizer step instead, if it is needed)",
    ),
    LayerRefusal(
        _EMBEDDINGS,
        lambda m: bool(m.sparse) and _trainable(m),
        "has sparse gradients, which no engine can take per example",
        "set sparse=False",
    ),
)


def check_parameter_types(model: nn.Module) -> None:
    """Refuse trainable parameters that are not all float32 or all float64, in one line: the clip
    bound's arithmetic (``clipping.clip_margin``) is derived for those, and 16-bit precision is the
    forward's (autocast), not the parameters' (a ``model.half()`` crashed inside the engines).

    Raises:
        ValueError: naming the types found and the fix.
    """
    types = {p.dtype for p in model.parameters() if p.requires_grad}
    if len(types) > 1 or types - {torch.float32, torch.float64}:
        found = ", ".join(sorted(str(t).removeprefix("torch.") for t in types))
        raise ValueError(
            f"per-example clipping takes trainable parameters all float32 or all float64, got {found}: keep the "
            "model in float32 and train in 16 bits with precision='bf16' or 'fp16' (autocast), or use .double()"
        )


def check_per_example_compatible(model: nn.Module, engine: str | None = None) -> None:
    """Refuse a model holding a layer that per-example clipping cannot handle (``REFUSED_LAYERS``):
    one that mixes examples (BatchNorm, norms with running statistics), writes private data into
    the model (``Embedding(max_norm=...)``) or has no per-example gradient (torch's RNN/GRU/LSTM).

    Args:
        model: the model to train.
        engine: the engine that will run it ("vmap", "bk", "ghost"), which adds the refusals of
            that engine alone; None: only what every engine refuses.

    Raises:
        ValueError: one line naming the first refused layer (its path in the model), why, and the fix.
    """
    for name, module in model.named_modules():
        for refusal in REFUSED_LAYERS:
            concerned = refusal.engines is None or engine in refusal.engines
            if concerned and isinstance(module, refusal.layers) and refusal.applies(module):
                raise ValueError(
                    f"layer {name or '<root>'!r} ({type(module).__name__}) {refusal.reason}; {refusal.fix}"
                )

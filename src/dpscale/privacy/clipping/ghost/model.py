"""The ghost engines' bookkeeping around a model: support, parameter routes, clip units and released sums.

Which layers the rules of ``dpscale.privacy.clipping.ghost.rules`` support (``unsupported_modules``), what
an engine learns about a model on its first passes (``ModelState``), the watch for parameters
used outside their layer's call, the clip units of a pass, each layer's released clipped sums,
and the route check that compares the records with autograd.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from dpscale.privacy.clipping.bounds import resolve_clip_groups
from dpscale.clip_norms import MaxGradNorm, is_per_layer
from dpscale.privacy.clipping.ghost.record import Record
from dpscale.privacy.clipping.ghost.rules import RULES
from dpscale.privacy.clipping.per_example import RELATIVE_ERROR_FLOOR, tolerance_for
from dpscale.privacy.noise.gaussian import Params


def _why_unsupported(module: nn.Module, trainable: list[str], prefix: str) -> str | None:
    """None if the layer's trainable parameters (local names) can be handled, else the reason."""
    rule = RULES.get(type(module))
    if rule is None:
        return f"{type(module).__name__}: no rule for its parameter(s) {', '.join(prefix + n for n in trainable)}"
    unknown = [prefix + n for n in trainable if n not in rule.params]
    # e.g. weight_norm's weight_g / weight_v, or an extra nn.Parameter attached to the layer
    if unknown:
        return f"{type(module).__name__} with parameter(s) {', '.join(unknown)} that its rule does not know"
    if isinstance(module, (nn.Conv1d, nn.Conv2d)) and (
        isinstance(module.padding, str) or module.padding_mode != "zeros"
    ):
        return f"{type(module).__name__} with padding={module.padding!r}, padding_mode={module.padding_mode!r}"
    if isinstance(module, nn.Embedding) and (
        module.max_norm is not None or module.scale_grad_by_freq
    ):
        return "Embedding with max_norm or scale_grad_by_freq"
    return None


def _tied_parameters(model: nn.Module) -> list[str]:
    """'a.weight = b.weight (tied parameter)' for every trainable tensor held by several layers
    (one layer registered under two names is one record, and not a tie)."""
    owners: dict[int, dict[tuple[int, str], str]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for local, p in module.named_parameters(recurse=False):
            if p.requires_grad:
                name = f"{prefix}.{local}" if prefix else local
                owners.setdefault(id(p), {}).setdefault((id(module), local), name)
    return [
        f"{' = '.join(group.values())} (tied parameter)"
        for group in owners.values()
        if len(group) > 1
    ]


def unsupported_modules(model: nn.Module) -> list[str]:
    """What the ghost/bk engines cannot handle exactly, found without running the model: layers
    without a rule, trainable parameters a layer's rule does not know, and tied parameters.

    Returns:
        one string per problem, naming the layer ("name (reason)") or the parameters.
    """
    # without importing dynamo
    if type(model).__name__ == "OptimizedModule" and "_orig_mod" in model._modules:
        return [
            "<root> (a torch.compile'd model: its layers run inside the compiled graph, where hooks cannot record "
            "them; pass the uncompiled module)"
        ]
    problems = []
    for name, module in model.named_modules():
        trainable = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        if trainable:
            reason = _why_unsupported(module, trainable, f"{name}." if name else "")
            if reason is not None:
                problems.append(f"{name or '<root>'} ({reason})")
    return problems + _tied_parameters(model)


class OutsideUseMonitor(TorchFunctionMode):
    """Watches one forward pass for trainable parameters of recorded layers that reach a
    differentiable operation outside their own layer's call (their gradient would then have a
    route the records do not see)."""

    def __init__(self, records: list[Record]) -> None:
        super().__init__()
        self.owner: dict[int, tuple[str, nn.Module]] = {}
        for r in records:
            for local, p in r.module.named_parameters(recurse=False):
                if r.trainable.get(local):
                    self.owner[id(p)] = (f"{r.name}.{local}" if r.name else local, r.module)
        self.active: list[nn.Module] = []  # the recorded layers whose call is running
        self.outside: dict[str, None] = {}  # ordered set of parameter names

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if any(t.requires_grad for t in _tensors(out)):  # .shape, .detach() etc. carry no gradient
            current = self.active[-1] if self.active else None
            for t in _tensors((args, kwargs)):
                # a view of the parameter (``fc.weight.T`` kept by the parent) is the parameter too
                hit = self.owner.get(id(t)) or (
                    self.owner.get(id(t._base)) if t._base is not None else None
                )
                if hit is not None and hit[1] is not current:
                    self.outside[hit[0]] = None
        return out


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors inside nested tuples/lists/dicts."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


@dataclass
class ModelState:
    """What an engine learned about one model on its first calls."""

    # (training mode, support_key) pairs whose first pass passed the route checks: a route that
    # exists only in train mode, or a parameter unfrozen later, is checked when it first runs.
    checked: set[tuple] = field(default_factory=set)
    copied: set[str] = field(default_factory=set)  # layers whose tensors are changed in place later
    # unsupported_modules costs ~0.6 ms on a ResNet-50: its verdict is kept while the parameter
    # set and their requires_grad flags stay the same.
    support_key: tuple = ()
    problems: list[str] = field(default_factory=list)
    # the trainable layers (module, name, local parameter -> trainable), walked once per parameter set
    layers: list[tuple] = field(default_factory=list)
    layers_key: tuple | None = None
    # the batched pass's index tensors (``add_deferred_norms``), by the layout of the pass
    indices: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def static_problems(self, model: nn.Module) -> list[str]:
        key = tuple((id(p), p.requires_grad) for p in model.parameters())
        if key != self.support_key:
            self.problems, self.support_key = unsupported_modules(model), key
        return self.problems

    def route_key(self, model: nn.Module) -> tuple:
        """Key of the routes a pass can take: training mode and the current parameter set."""
        self.static_problems(model)
        return (model.training, self.support_key)


def add_deferred_norms(
    records: list[Record], layer_sq: Mapping[str, torch.Tensor | None], state: ModelState
) -> dict[str, torch.Tensor]:
    """Each layer's per-example squared norms (B,), its deferred parts' squares (``small_part``)
    added, for every layer at once: the deferred per-example gradients side by side, squared and
    summed by layer in float64 with the layers' other terms (a float32 square is exact there, and
    the float64 sum errs far below ``clip_margin``'s float32 terms), then taken to the records'
    type; about ten operators for the whole model instead of three or four per bias or norm layer.

    Args:
        records: the pass's records (their ``deferred`` names in ``cache``).
        layer_sq: layer name -> the rule's squared norms, None when all its terms were deferred.
        state: the engine's state of this model (keeps the index tensors of each layout).

    Returns:
        layer name -> squared norms (B,), for every record.
    """
    # each layer's deferred terms: its small cached gradients, then its weights' block norms
    terms = [
        (r.name, t)
        for r in records
        for t in [*(r.cache[local] for local in r.deferred), *r.squares]
    ]
    if not terms:
        return {name: sq for name, sq in layer_sq.items() if sq is not None}
    names = [r.name for r in records]
    direct = [name for name in names if layer_sq[name] is not None]
    device, dtype = terms[0][1].device, terms[0][1].dtype
    layout = (tuple(names), tuple((name, t.shape[1:]) for name, t in terms), tuple(direct), device)
    if layout not in state.indices:
        position = {name: i for i, name in enumerate(names)}
        columns = [position[name] for name, t in terms for _ in range(math.prod(t.shape[1:]))]
        state.indices[layout] = (
            torch.tensor(columns, device=device),
            torch.tensor([position[name] for name in direct], device=device),
        )
    by_column, by_layer = state.indices[layout]
    flat = _side_by_side([t for _, t in terms]).double()
    total = flat.new_zeros(len(names), flat.shape[0]).index_add_(0, by_column, flat.square().t())
    if direct:
        total.index_add_(0, by_layer, torch.stack([layer_sq[name] for name in direct]).double())  # type: ignore[misc]
    return dict(zip(names, total.to(dtype).unbind(0)))


def full_name(layer: str, local: str) -> str:
    """A parameter's name in the model from its layer's name and its own."""
    return f"{layer}.{local}" if layer else local


@dataclass(frozen=True)
class Units:
    """What ``clip_units`` clips for one pass: each layer as one unit (its norms come per
    layer), except the layers that per-layer clipping splits between groups (per-tensor clipping
    splits every layer with a weight and a bias), whose tensors are units of their own.

    Attributes:
        sq: unit -> per-example squared norms (B,): a layer's by its name, a tensor's by its full name.
        slack: unit -> slack (B,) of its release (``Record.slack``: a split layer's goes to its weight).
        group_of: unit -> per-layer clipping group (None: one C for the whole gradient).
        split: the layers clipped tensor by tensor.
    """

    sq: dict[str, torch.Tensor]
    slack: dict[str, torch.Tensor]
    group_of: dict[str, int] | None
    split: frozenset[str]


def units_of_pass(
    records: list[Record],
    layer_sq: dict[str, torch.Tensor],
    max_grad_norm: MaxGradNorm,
    params: Params,
) -> Units:
    """The units and groups of a pass; a split layer's entry in ``layer_sq`` is set to the sum
    of its tensors' norms (what is clipped is what the self-check compares).

    Raises:
        ValueError: a split layer whose rule gave no norm for one of its tensors.
    """
    slack = {r.name: r.slack for r in records if r.slack is not None}
    if not is_per_layer(max_grad_norm):
        return Units(layer_sq, slack, None, frozenset())
    # per-layer bounds: a mapping pattern -> C_g (is_per_layer)
    assert isinstance(max_grad_norm, Mapping)
    param_group = resolve_clip_groups(max_grad_norm, list(params)).group_of
    sq, unit_slack, group_of, split = {}, {}, {}, set()
    for r in records:
        names = {
            local: full_name(r.name, local) for local, trainable in r.trainable.items() if trainable
        }
        groups = {param_group[n] for n in names.values()}
        if len(groups) == 1:  # the layer's tensors clipped together, from its own norm
            sq[r.name], group_of[r.name] = layer_sq[r.name], groups.pop()
            if r.slack is not None:
                unit_slack[r.name] = r.slack
            continue
        missing = [n for local, n in names.items() if local not in r.parts]
        if missing or (r.slack is not None and "weight" not in names):
            raise ValueError(
                f"{type(r.module).__name__} {r.name!r}: its rule gives no norm of its own for "
                f"{', '.join(missing) or 'the weight'}, which per-layer clipping puts in a group apart; use engine=vmap"
            )
        split.add(r.name)
        for local, name in names.items():
            sq[name], group_of[name] = r.parts[local], param_group[name]
        if r.slack is not None:  # the weight's release alone accumulates positions
            unit_slack[names["weight"]] = r.slack
        layer_sq[r.name] = sum(
            (r.parts[local] for local in names), torch.zeros_like(layer_sq[r.name])
        )
    return Units(sq, unit_slack, group_of, frozenset(split))


def _side_by_side(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per-example tensors (B, ...) as the columns of one (B, n) tensor (a 2-d one without a reshape)."""
    return torch.cat([t if t.dim() == 2 else t.reshape(t.shape[0], -1) for t in tensors], 1)


def released_all(records: list[Record], factors: dict[str, torch.Tensor], units: Units) -> Params:
    """Every layer's clipped sums by full parameter name: the deferred small gradients'
    (``small_part``, one clip factor for all of them) as one product and one cut for the whole
    model, the rest by their rules (``released``)."""
    deferred = [(r, local) for r in records for local in r.deferred]
    out: Params = {}
    if deferred:
        # every deferred unit has the same factors (defer only runs under one bound): c @ [g_1 ... g_n]
        # is each tensor's sum_i c_i g_i; rows zeroed since the norms (non-finite examples) are read now
        flat = _side_by_side([r.cache[local] for r, local in deferred])
        # the parameters, for their shapes
        like: list[torch.Tensor] = [getattr(r.module, local) for r, local in deferred]
        summed = torch._C._nn.unflatten_dense_tensors(factors[deferred[0][0].name] @ flat, like)
        out.update({full_name(r.name, local): s for (r, local), s in zip(deferred, summed)})
    for r in records:
        kept = (
            r
            if not r.deferred
            else replace(
                r, trainable={n: t and n not in r.deferred for n, t in r.trainable.items()}
            )
        )
        out.update(
            {full_name(r.name, local): s for local, s in released(kept, factors, units).items()}
        )
    return out


def released(r: Record, factors: dict[str, torch.Tensor], units: Units) -> Params:
    """A layer's clipped sums by local name: its rule's sums with the layer's factors, or for a
    split layer with each tensor's own (the rule run for that tensor alone)."""
    rule = RULES[type(r.module)]
    if r.name not in units.split:
        return rule.sums(r, r.inputs, r.out_grad, factors[r.name])
    out: Params = {}
    for local, trainable in r.trainable.items():
        if trainable:
            alone = replace(r, trainable={n: n == local for n in r.trainable})
            out[local] = rule.sums(alone, r.inputs, r.out_grad, factors[full_name(r.name, local)])[
                local
            ]
    return out


def unseen_routes(
    records: list[Record], true: dict[str, torch.Tensor | None], rows: torch.Tensor
) -> list[str]:
    """Parameters whose autograd gradient differs from the unclipped sum of the records'
    per-example gradients: a route the records do not see (a view or copy of the parameter used
    elsewhere, a replaced ``forward``, a global hook changing an output).

    Args:
        records: the pass's records, norms already computed (caches filled).
        true: parameter name -> its gradient of the summed loss by autograd (None: unused).
        rows: ones, one per example (the clip factors of an unclipped sum).

    Returns:
        "name (records x off, relative)" for each such parameter, compared at the tolerance of its
        gradient's dtype (float32 for a 16-bit engine: its check runs on a float32 pass).
    """
    from_records: Params = {}
    for r in records:
        for local, s in RULES[type(r.module)].sums(r, r.inputs, r.out_grad, rows).items():
            from_records[f"{r.name}.{local}" if r.name else local] = s
    sizes = {
        n: float(torch.linalg.vector_norm(t)) if t is not None else 0.0 for n, t in true.items()
    }
    scale = RELATIVE_ERROR_FLOOR * max(sizes.values(), default=0.0) + 1e-300
    unseen = []
    for name, t in true.items():
        got = from_records.get(name)
        if t is None:  # unused by autograd, yet the records give it a gradient
            if got is None:
                continue
            t = torch.zeros_like(got)
        error = float(torch.linalg.vector_norm(t - (torch.zeros_like(t) if got is None else got)))
        if error > tolerance_for(t.dtype) * max(sizes[name], scale):
            unseen.append(f"{name} (records {error / max(sizes[name], scale):.2g} off, relative)")
    return unseen

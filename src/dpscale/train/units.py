"""Physical chunks of whole users (issue 43): a user's examples are clipped as one vector, so a
chunk never splits a user. Every path that feeds a user-level step (``mechanism.step``, its
``data_loader``, the Trainer) cuts the drawn batch here, then pads it with ``user_rows``."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, cast

import numpy as np
import torch

from dpscale.data.user_ids import UserIndex, user_slices

from dpscale.privacy.sampling.units import UnitBatch
from dpscale.privacy.clipping.per_example import Batch, UnitChunk, user_rows
from dpscale.privacy.plan.dp_plan import DPPlan
from dpscale.train.step import AugmentViews


def rows_per_user(plan: DPPlan) -> int:
    """k, the examples a drawn user contributes per step, of a plan at the user unit.

    Raises:
        ValueError: the plan is at the example unit (it has no k).
    """
    if plan.max_examples_per_user is None:
        raise ValueError("the DP plan is at the example unit: it has no max_examples_per_user")
    return plan.max_examples_per_user


def users_per_chunk(max_physical_batch_size: int | None, rows: int, views: int, users: int) -> int:
    """Users per physical chunk: as many as fit ``max_physical_batch_size`` examples once padded to
    k rows of K views each (at least one), or all ``users`` without a limit."""
    if max_physical_batch_size is None:
        return max(1, users)
    return max(1, max_physical_batch_size // (rows * views))


def check_chunk_fits(max_physical_batch_size: int | None, rows: int) -> None:
    """Refuse a physical batch smaller than one user's k examples (the rule for a user larger
    than a chunk: it would have to be split, and its gradient is clipped as one)."""
    if max_physical_batch_size is not None and max_physical_batch_size < rows:
        raise ValueError(
            f"max_physical_batch_size={max_physical_batch_size} is smaller than max_examples_per_user={rows}: a chunk "
            "never splits a user; raise it to at least k"
        )


def gathered_user_chunks(
    x: torch.Tensor, y: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, per_chunk: int
) -> Iterator[UnitChunk]:
    """A drawn batch of users, gathered from the whole training set chunk by chunk.

    Args:
        x, y: all training examples; indices: the batch's examples, each user's consecutive;
        offsets: user j holds ``indices[offsets[j]:offsets[j + 1]]``; per_chunk: users per chunk.

    Returns:
        (x, y, offsets) chunks of whole users.
    """
    for start, end, local in user_slices(offsets, per_chunk):
        rows = indices[start:end].to(x.device)
        yield x[rows], y[rows], local


class DrawnChunks(list):
    """``data_loader``'s physical chunks of one logical batch, with the dataset indices they hold,
    in order (what ``mechanism.step`` checks them against)."""

    def __init__(self, chunks: Iterable[Batch], indices: torch.Tensor) -> None:
        super().__init__(chunks)
        self.indices = indices


def check_gathered(indices: Any, drawn: torch.Tensor, *, chunks: bool) -> None:
    """Refuse examples gathered from other indices than the draw (nothing given: nothing to check).

    Args:
        indices: the dataset indices the step's examples came from, in their order, or None.
        drawn: the drawn indices; chunks: the examples come as chunks (then in the drawn order).

    Raises:
        ValueError: other indices, or (chunks) another order; nothing was released.
    """
    if indices is None:
        return
    given = torch.as_tensor(indices).reshape(-1).cpu()
    same = len(given) == len(drawn) and bool(
        torch.equal(given, drawn)
        if chunks
        else torch.equal(given.sort().values, drawn.sort().values)
    )
    if not same:
        order = " in the drawn order" if chunks else ""
        raise ValueError(
            f"the step's examples come from other indices than the drawn ones{order}: gather exactly the indices "
            "that mechanism.batches()/sample() gave (or use mechanism.data_loader); nothing was released"
        )


def user_step_chunks_of(
    inputs: Any,
    targets: torch.Tensor | None,
    indices: Any,
    drawn: UnitBatch,
    rows: int,
    views: int,
    max_physical_batch_size: int | None,
) -> Iterator[Batch]:
    """``mechanism.step``'s examples at the user unit as padded chunks of whole users: tensors
    gathered in any order of the drawn indices are put back in the drawn order (each user's
    examples together); chunks must come in the drawn order and end where a user's examples end.

    Raises:
        ValueError: no ``indices``, other indices, or chunks in another order (before anything is
            computed), or chunks that split a user (while the engine reads them).
    """
    if indices is None:
        raise ValueError(
            "at the user unit mechanism.step needs indices= (the dataset indices your examples were gathered from, "
            "in their order): a user's examples are clipped together, so the step must know which are whose; "
            "mechanism.data_loader's chunks carry them"
        )
    check_gathered(indices, drawn.indices, chunks=targets is None)
    if targets is None:
        return padded_user_chunks(cut_at_users(inputs, drawn.offsets), rows, views)
    given = torch.as_tensor(indices).reshape(-1).cpu()
    order = torch.empty_like(drawn.indices)
    order[torch.argsort(drawn.indices)] = torch.argsort(given)  # given[order[j]] == drawn[j]
    x, y = inputs[order.to(inputs.device)], targets[order.to(targets.device)]
    per_chunk = users_per_chunk(max_physical_batch_size or max(1, len(y)), rows, 1, 0)
    raw = ((x[a:b], y[a:b], local) for a, b, local in user_slices(drawn.offsets, per_chunk))
    return padded_user_chunks(raw, rows, views)


def cut_at_users(chunks: Iterable[Batch], offsets: torch.Tensor) -> Iterator[UnitChunk]:
    """The (x, y) chunks a user's loop passes, with each chunk's users: every chunk must end where
    a drawn user's examples end, and all must add up to the drawn batch (else ValueError, raised
    while the engine reads the chunks: before anything is released)."""
    ends = offsets.cpu().tolist()
    cursor = 0
    for x, y in chunks:
        end = cursor + len(y)
        if end not in ends or len(y) == 0:
            raise ValueError(
                f"a physical chunk (rows {cursor}..{end} of the drawn batch) splits a user: chunks must end where a "
                "user's examples end (mechanism.data_loader cuts them so); nothing was released"
            )
        first, last = ends.index(cursor), ends.index(end)
        yield x, y, torch.tensor(ends[first : last + 1], dtype=torch.int64) - cursor
        cursor = end
    if cursor != ends[-1]:
        raise ValueError(
            f"the chunks hold {cursor} examples but the drawn users hold {ends[-1]}; nothing was released"
        )


def padded_user_chunks(
    chunks: Iterable[UnitChunk],
    rows: int,
    views: int,
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Iterator[Batch]:
    """Each chunk of users as the engine takes it (``user_rows``), its images first made into K
    views by ``augment`` (AugMult: (n, ...) -> (n, K, ...)) when given."""
    for x, y, offsets in chunks:
        yield user_rows((augment(x) if augment is not None else x, y, offsets), rows, views)


def run_users(plan: DPPlan, data: Any) -> UserIndex | None:
    """The users a run's sampler draws (None at the example unit), from its training set's ids."""
    return UserIndex.from_ids(data.user_ids) if plan.user_level else None


def first_users_chunk(
    data: Any,
    count: int,
    rows: int,
    views: int,
    augment: Callable[[torch.Tensor], torch.Tensor] | None,
) -> Batch:
    """The set-up check's chunk at the user unit: the first ``count`` users (in id order), each
    with its first k examples, their K views from ``augment``, padded as the steps pad them.

    Args:
        data: the training set (``user_ids`` set); count: users; rows: k; views: K.
        augment: (n, ...) -> (n, K, ...) views, or None (K = 1).
    """
    users = UserIndex.from_ids(data.user_ids)
    count = min(count, users.num_users)
    sizes = torch.from_numpy(np.minimum(users.sizes[:count], rows))
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
    picks = np.concatenate(
        [users.examples[a : a + int(n)] for a, n in zip(users.offsets[:count], sizes)]
    )
    x, y = _examples(data, picks)
    return user_rows((augment(x) if augment is not None else x, y, offsets), rows, views)


def _examples(data: Any, picks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Training examples ``picks`` as model input: from memory, or read from a stream's disk."""
    if hasattr(data, "x_train"):
        index = torch.from_numpy(picks).to(data.x_train.device)
        return data.x_train[index], data.y_train[index.to(data.y_train.device)]
    from dpscale.data.stream import to_model_input

    x = torch.from_numpy(np.stack([data.train.read(int(i)) for i in picks]))
    return to_model_input(x, data.normalize), data.y_train[torch.from_numpy(picks)]


def user_step_chunks(
    drawn: UnitBatch,
    data: Any,
    plan: DPPlan,
    max_physical_batch_size: int | None,
    augment: AugmentViews,
) -> Iterator[Batch]:
    """The Trainer's step at the user unit: the drawn users gathered in chunks of whole users,
    each example made into its K views, padded to k rows per user (``user_rows``)."""
    k = rows_per_user(plan)
    per_chunk = users_per_chunk(max_physical_batch_size, k, augment.views, drawn.num_units)
    raw = gathered_user_chunks(data.x_train, data.y_train, drawn.indices, drawn.offsets, per_chunk)
    return padded_user_chunks(raw, k, augment.views, augment if augment.views > 1 else None)


def chunk_size_for(plan: DPPlan, max_physical_batch_size: int, views: int) -> int:
    """Per physical chunk: max_physical_batch_size / K examples, or at the user unit as many
    whole users as fit once padded to k rows of K views (``users_per_chunk``)."""
    if plan.user_level:
        return users_per_chunk(max_physical_batch_size, rows_per_user(plan), views, 0)
    return max(1, max_physical_batch_size // views)


def streamed_chunks(
    chunks: Iterable[tuple[torch.Tensor, ...]], plan: DPPlan, augment: AugmentViews
) -> Iterable[Batch]:
    """A stream's chunks as the engine takes them: each example's K views, and at the user unit
    ((x, y, offsets) chunks of whole users) padded to k rows per user."""
    if plan.user_level:  # the stream cuts (x, y, offsets) chunks at the user unit, else (x, y)
        users = cast(Iterable[UnitChunk], chunks)
        return padded_user_chunks(
            users, rows_per_user(plan), augment.views, augment if augment.views > 1 else None
        )
    return augment.chunks(cast(Iterable[Batch], chunks))

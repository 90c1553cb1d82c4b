"""Fixed shapes (issue 63, point 3): every chunk padded with zero rows to one size, which weigh
exactly nothing (loss, gradient, norm, count), through ``make_private(fixed_shapes=True)``.

The reference is the same seeded run unpadded, in float64: the same releases (to float64's
reordering of the sums), the same counts and the same epsilon.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch
from torch import nn

import dpscale
from dpscale.privacy.clipping.engines import make_engine
from dpscale.privacy.clipping.per_example import PaddedChunk, pad_chunk, trainable_params
from dpscale.train import step as step_module
from dpscale.train.step import pad_rows_for

N, CAP = 120, 7


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.Tanh(), nn.GroupNorm(1, 3), nn.Flatten(), nn.Linear(3 * 4 * 4, 4)
    ).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 1, 6, 6, generator=g, dtype=torch.float64), torch.randint(
        0, 4, (N,), generator=g
    )


@contextlib.contextmanager
def _chunk_rows() -> Iterator[list[int]]:
    """The rows of every chunk an engine is given while the block runs (``step._add_chunk`` watched)."""
    seen: list[int] = []
    add_chunk = step_module._add_chunk

    def watched(engine, model, params, chunk, *rest):
        seen.append(chunk[0].shape[0])
        return add_chunk(engine, model, params, chunk, *rest)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step_module, "_add_chunk", watched)
        yield seen


def _steps(
    model: nn.Module, dtype: torch.dtype = torch.float64, **options
) -> tuple[list[dict], list[int], float, list[int]]:
    """A seeded make_private run on ``_data`` (examples in ``dtype``): (released gradients, examples
    counted, epsilon, rows of every chunk the engine saw)."""
    mechanism = dpscale.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        dataset_size=N,
        batch_size=6,
        max_grad_norm=0.5,
        noise_multiplier=1.0,
        delta=1e-5,
        seed=3,
        **options,
    )
    released, counts = [], []
    mechanism.observer = lambda gradient: released.append(
        {k: v.clone() for k, v in gradient.items()}
    )
    x, y = _data()
    with _chunk_rows() as seen:
        for indices in mechanism.batches():
            counts.append(mechanism.step(x[indices].to(dtype), y[indices]).examples)
    return released, counts, mechanism.epsilon(), seen


def _run(
    engine: str, fixed_shapes: bool, steps: int = 6, **options
) -> tuple[list[dict], list[int], float, list[int]]:
    """``_steps`` of ``_model`` (float64) with this engine, padded or not."""
    return _steps(_model(), engine=engine, fixed_shapes=fixed_shapes, steps=steps, **options)


@pytest.mark.parametrize("engine", ["bk", "ghost", "vmap"])
def test_a_capped_run_padded_to_the_cap_releases_what_the_unpadded_run_does(engine):
    plain, plain_counts, plain_eps, plain_seen = _run(engine, False, max_batch_size=CAP)
    padded, padded_counts, padded_eps, padded_seen = _run(engine, True, max_batch_size=CAP)
    # padded: one shape; unpadded: several
    assert set(padded_seen) == {CAP} and len(set(plain_seen)) > 1
    assert padded_counts == plain_counts and max(plain_counts) <= CAP
    assert padded_eps == plain_eps
    for want, got in zip(plain, padded, strict=True):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-15)


def test_padding_rows_weigh_nothing_with_automatic_clipping_too():
    """C / (0 + gamma) is large: a padding row must still add exactly zero, its norm uncounted."""
    model = _model()
    x, y = _data()
    engine, _ = make_engine("bk", 0.5, model, clip_gamma=0.01)
    params = trainable_params(model)
    want, want_norms, want_losses = engine.clipped_sum_and_losses(model, params, (x[:5], y[:5]))
    padded = pad_chunk((x[:5], y[:5]), 9)
    assert isinstance(padded, PaddedChunk) and padded[0].shape[0] == 9 and padded.rows == 5
    got, norms, losses = engine.clipped_sum_and_losses(model, params, padded)
    assert norms.shape == (5,) and losses.shape == (5,)
    torch.testing.assert_close(norms, want_norms, rtol=1e-12, atol=0)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-15)


def test_a_chunk_as_large_as_the_size_is_not_padded():
    x, y = _data()
    assert not isinstance(pad_chunk((x[:4], y[:4]), 4), PaddedChunk)


def test_fixed_shapes_refuse_uncapped_poisson_without_a_chunk_size_in_one_line():
    with pytest.raises(ValueError, match="uncapped Poisson batches have no largest size") as err:
        _run("bk", True, steps=1)
    assert "\n" not in str(err.value)


def test_the_padded_size_is_the_smallest_bound():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = dpscale.make_private(
        model,
        optimizer,
        dataset_size=N,
        batch_size=10,
        max_grad_norm=0.5,
        noise_multiplier=1.0,
        delta=1e-5,
        steps=2,
        max_batch_size=CAP,
    ).plan
    assert (
        pad_rows_for(plan, None) == CAP
        and pad_rows_for(plan, 5) == 5
        and pad_rows_for(plan, 64) == CAP
    )


@pytest.mark.slow  # a first torch.compile costs ~10-30 s on 2 cores
def test_a_compiled_capped_run_is_padded_to_the_cap_and_releases_what_the_eager_run_does():
    """compile=True pads a capped run's chunks to the cap by default (one shape, compiled once) and
    masks the padding: the counts and epsilon of the eager vmap run, its releases to float32."""

    def run(**options):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(36, 6), nn.Tanh(), nn.Linear(6, 4))
        return _steps(model, torch.float32, steps=5, max_batch_size=CAP, **options)

    eager, eager_counts, eager_eps, _ = run(engine="vmap")
    compiled, compiled_counts, compiled_eps, seen = run(compile=True)
    assert set(seen) == {CAP} and compiled_counts == eager_counts and compiled_eps == eager_eps
    for want, got in zip(eager, compiled, strict=True):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6)


def test_dpscale_train_with_fixed_shapes_pads_every_chunk_and_trains_as_the_unpadded_run(tmp_path):
    """The Trainer's door: train.fixed_shapes pads each chunk to train.max_physical_batch_size (or
    the cap when smaller); the same counts, epsilon and, to float32, the same weights."""
    from dpscale.train import Trainer
    from helpers import tiny_config

    def run(name: str, fixed: str) -> tuple[dict, list[int], dict]:
        config = tiny_config(
            tmp_path / name,
            "run.seed=5",
            "dp.max_batch_size=70",
            "train.max_physical_batch_size=32",
            "train.engine=bk",
            f"train.fixed_shapes={fixed}",
        )
        with _chunk_rows() as seen:
            trainer = Trainer.create(config)
            summary = trainer.run()
        return summary, seen, {k: v.clone() for k, v in trainer.built.model.state_dict().items()}

    plain, plain_seen, plain_weights = run("plain", "false")
    padded, padded_seen, padded_weights = run("padded", "true")
    assert set(padded_seen) == {32} and len(set(plain_seen)) > 1
    assert padded["epsilon"] == plain["epsilon"]
    for name, want in plain_weights.items():
        torch.testing.assert_close(padded_weights[name], want, rtol=1e-5, atol=1e-6)

"""The tuner through make_private and `dpscale train` (issue 44): the methods are logged and kept
in the summary, a checkpoint's choices are pinned on resume so a resumed run computes
bit-identically with tuning on, a cache forcing bmm-positions trains as bmm does, and a first run's
peak measurements print no profiler lines."""

from __future__ import annotations

import json
import os

import torch

from dpscale.privacy.clipping import autotune
from autotune_helpers import cache_as_written, convs


def _cache_forcing(path, pick) -> None:
    """Rewrite every entry's method to ``pick(key, method)`` (its prediction the timed one, or 1 ms)."""
    table = json.loads(path.read_text())
    for entries in table.values():
        for key, entry in entries.items():
            entry["method"] = pick(key, entry["method"])
            entry["ms"].setdefault(entry["method"], 1.0)
    path.write_text(json.dumps(table))


def _private_convs(x: torch.Tensor, y: torch.Tensor, steps_before_save: int | None, saved=None):
    """``convs`` trained by make_private (bk, tuning as set) on (x, y), from ``saved`` (model,
    optimizer and mechanism states) if given; returns (model, mechanism, the states after
    ``steps_before_save`` steps or None)."""
    from dpscale.train.private import make_private

    torch.manual_seed(1)
    model = convs()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mechanism = make_private(
        model,
        optimizer,
        dataset_size=64,
        batch_size=16,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        delta=1e-5,
        steps=6,
        engine="bk",
        seed=3,
    )
    if saved is not None:
        model.load_state_dict(saved[0])
        optimizer.load_state_dict(saved[1])
        mechanism.load_state_dict(saved[2])
    state = None
    for taken, indices in enumerate(mechanism.batches()):
        mechanism.step(x[indices], y[indices])
        if taken + 1 == steps_before_save:
            state = (
                {k: v.clone() for k, v in model.state_dict().items()},
                optimizer.state_dict(),
                mechanism.state_dict(),
            )
    return model, mechanism, state


def test_make_private_resumes_bit_identically_with_the_checkpoints_methods(tmp_path, monkeypatch):
    """Tuning on (every chunk large enough): the resumed mechanism takes the saved choices, even
    where its own tuner would have chosen otherwise, and the weights match step for step."""
    monkeypatch.setattr(autotune, "TUNE_MIN_MACS", 0.0)
    cache_as_written(monkeypatch)
    monkeypatch.setenv("DPSCALE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DPSCALE_AUTOTUNE", "1")
    torch.manual_seed(0)
    x, y = torch.randn(64, 3, 9, 9), torch.randint(0, 10, (64,))
    whole, mechanism, saved = _private_convs(x, y, 3)
    methods = saved[2]["clip_methods"]["methods"]
    assert methods and set(methods.values()) <= {
        "pixel-gram",
        "gram",
        "bmm",
        "bmm-positions",
        "grouped",
    }
    # a resuming machine whose cache says otherwise: the checkpoint's choices still hold
    other = {
        "pixel-gram": "grouped",
        "gram": "bmm",
        "bmm": "gram",
        "bmm-positions": "grouped",
        "grouped": "gram",
    }
    cache = tmp_path / "autotune.json"
    _cache_forcing(cache, lambda key, method: other[method])
    resumed, resumed_mechanism, _ = _private_convs(x, y, None, saved)
    assert resumed_mechanism.engine.tuner.as_json()["methods"] == methods
    assert all(torch.equal(resumed.state_dict()[k], v) for k, v in whole.state_dict().items())
    assert os.path.exists(cache)


def _trainer_config(out):
    """A 4-step run of the default model at ``out`` (seed 0, B = 32, epsilon 4)."""
    from dpscale.config import load_config

    return load_config(
        None,
        [
            f"run.out_dir={out}",
            "run.seed=0",
            "dp.batch_size=32",
            "dp.epsilon=4",
            "train.steps=4",
            "train.eval_every_epochs=1",
        ],
    )


def test_dpscale_train_logs_the_choices_and_a_resume_takes_them(tmp_path, monkeypatch, capsys):
    """Through the trainer: the methods are logged after the first step and kept in the summary;
    a run stopped and resumed (the cache rewritten to other methods in between) equals the
    uninterrupted run."""
    from dpscale._io import load_checkpoint
    from dpscale.train.loop import Trainer

    monkeypatch.setattr(autotune, "TUNE_MIN_MACS", 0.0)
    cache_as_written(monkeypatch)  # the split run takes the full run's choices from the cache
    monkeypatch.setenv("DPSCALE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("DPSCALE_AUTOTUNE", "1")

    full = Trainer.create(_trainer_config(tmp_path / "full"), progress=False, report=True)
    summary = full.run()
    err = capsys.readouterr().err
    assert "clip methods on cpu:" in err and "(timed now" in err
    layers = full.built.engine.tuner.as_json()["layers"]
    assert layers and all(
        kind.startswith("timed") or kind == "estimate" for _, kind, _ in layers.values()
    )
    assert summary["clip_methods"] == {name: method for name, (method, _, _) in layers.items()}
    assert (
        Trainer.create(_trainer_config(tmp_path / "split"), progress=False, report=True).run(
            max_steps=2
        )
        is None
    )
    assert "(cached 20" in capsys.readouterr().err  # from the cache, and the line says so
    cache = tmp_path / "cache" / "autotune.json"
    other = {
        "pixel-gram": "gram",
        "gram": "bmm",
        "bmm": "gram",
        "bmm-positions": "gram",
        "grouped": "bmm",
    }
    # the resuming machine would choose otherwise
    _cache_forcing(cache, lambda key, method: other[method])
    resumed = Trainer.resume(tmp_path / "split", progress=False)
    timings = ("wall_time_s", "engine_self_check")
    assert {k: v for k, v in resumed.run().items() if k not in timings} == {
        k: v for k, v in summary.items() if k not in timings
    }
    assert all(
        kind == "pinned" for _, kind, _ in resumed.built.engine.tuner.as_json()["layers"].values()
    )
    full, split = (
        load_checkpoint(tmp_path / "full" / "checkpoint.pt"),
        load_checkpoint(tmp_path / "split" / "checkpoint.pt"),
    )
    assert all(torch.equal(t, split["model"][k]) for k, t in full["model"].items())


def test_dpscale_train_with_every_conv_on_bmm_positions_trains_as_bmm_does(tmp_path, monkeypatch):
    """Through `dpscale train`: a cache that puts papernot-cnn's convolutions on bmm-positions (its
    kernel-major per-example gradients, the clipped sum reordered) passes the run's self-check
    against the per-example loop and trains the weights that bmm gives, up to float32 rounding (the
    same seed draws the same noise)."""
    from dpscale._io import load_checkpoint
    from dpscale.cli import main

    monkeypatch.setenv("DPSCALE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("DPSCALE_AUTOTUNE", "1")
    # every layer timed once, so the cache lists them
    monkeypatch.setattr(autotune, "TUNE_MIN_MACS", 0.0)
    cache_as_written(monkeypatch)  # the forced methods are taken, however they time
    sets = [
        "model.name=papernot-cnn",
        "run.seed=0",
        "dp.batch_size=32",
        "train.steps=2",
        "run.tensorboard=false",
    ]

    def train(out: str) -> dict:
        args = [a for v in [*sets, f"run.out_dir={tmp_path / out}"] for a in ("--set", v)]
        assert main(["train", "--quiet", *args]) == 0
        return json.loads((tmp_path / out / "summary.json").read_text())

    train("timed")
    cache = tmp_path / "cache" / "autotune.json"
    runs = {}
    for method in ("bmm-positions", "bmm"):
        _cache_forcing(
            cache, lambda key, m, forced=method: forced if key.startswith("Conv2d") else m
        )
        summary = train(method)
        # None: auto fell back to vmap (the route check refused the records)
        methods = summary["clip_methods"] or {}
        assert [m for name, m in methods.items() if name.startswith("features")] == [
            method,
            method,
        ], summary["engine"]
        runs[method] = load_checkpoint(tmp_path / method / "checkpoint.pt")["model"]
    for name, weight in runs["bmm"].items():
        torch.testing.assert_close(runs["bmm-positions"][name], weight, rtol=1e-4, atol=1e-6)


def test_a_first_dpscale_train_run_prints_no_profiler_lines(tmp_path, monkeypatch, capfd):
    """A fresh cache: the tuner times each layer's methods and, for those within the noise (every
    one here), measures their peaks under the profiler; stderr has the tuner's line, no 'USDT'."""
    from dpscale.train.loop import Trainer
    from helpers import tiny_config

    monkeypatch.setattr(autotune, "TUNE_MIN_MACS", 0.0)
    monkeypatch.setattr(autotune, "TUNE_TIE", 1e9)  # every timed candidate is a tie: peaks decide
    monkeypatch.setenv("DPSCALE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("DPSCALE_AUTOTUNE", "1")
    config = tiny_config(
        tmp_path / "run", "model.name=papernot-cnn", "train.steps=1", "train.engine=bk"
    )
    Trainer.create(config, progress=False, report=True).run()
    err = capfd.readouterr().err
    assert "least memory (peak MB" in err and "USDT" not in err

"""Runs on features: accounting of private Data Normalization, reuse of its statistics, eval."""

import json

import pytest
import torch

from dpscale.cli import main
from dpscale.config import load_config
from dpscale.errors import ConfigError
from dpscale.privacy import compute_epsilon
from dpscale.privacy.accounting.segments import AccountingSegment
from dpscale._io import load_checkpoint
from dpscale.train.loop import Trainer

pytest.importorskip("kymatio")

SCATTER = (
    "features.extractor=scatternet",
    "data.normalize=false",
    "model.name=scatter-linear",
    "dp.max_grad_norm=0.1",
)


def scatter_config(out_dir, *extra):
    return load_config(
        None,
        [
            f"run.out_dir={out_dir}",
            "run.seed=0",
            "dp.batch_size=500",
            "dp.epsilon=3",
            "dp.accountant=rdp",
            "train.steps=16",
            "optim.lr=4",
            "optim.momentum=0.9",
            *SCATTER,
            *extra,
        ],
    )


def test_datanorm_run_spends_its_budget_on_both_releases(tmp_path):
    cfg = scatter_config(
        tmp_path / "r",
        "features.normalize=datanorm",
        "features.norm_clip=[0.2, 0.05]",
        "features.norm_noise=6",
    )
    trainer = Trainer.create(cfg, progress=False)
    release = AccountingSegment(1.0, 6.0, 2, "data-norm")
    assert trainer.plan.releases == (release,)
    assert (
        trainer.mechanism.accountant.releases == (release,)
        and trainer.mechanism.accountant.steps == 0
    )
    assert trainer.epsilon() > 0  # the statistics are released before the first step
    summary = trainer.run()
    q, sigma = 500 / 4000, summary["noise_multiplier"]
    alone = compute_epsilon(sample_rate=q, noise_multiplier=sigma, steps=16, delta=1e-5, kind="rdp")
    composed = compute_epsilon(
        sample_rate=q, noise_multiplier=sigma, steps=16, delta=1e-5, kind="rdp", releases=(release,)
    )
    assert summary["epsilon"] == pytest.approx(composed) and alone < composed <= 3.0
    assert set(summary["epsilon_parts"]) == {"data-norm", "dp-sgd"}
    assert summary["feature_normalization"] == "datanorm" and summary["features"] == "scatternet"
    # Calibration accounted for the release: DP-SGD alone would have needed less noise.
    plain = Trainer.create(
        scatter_config(tmp_path / "g", "features.normalize=groupnorm", "features.groups=27"),
        progress=False,
    )
    assert plain.plan.noise_multiplier < sigma and not plain.plan.releases
    assert summary["test_accuracy"] > 0.8  # 16 steps on ScatterNet features already learn MNIST


def test_released_statistics_are_checkpointed_and_reused_by_eval(tmp_path, capsys):
    cfg = scatter_config(
        tmp_path / "r", "features.normalize=datanorm", "features.norm_clip=[0.2, 0.05]"
    )
    trainer = Trainer.create(cfg, progress=False)
    trainer.run()
    state = load_checkpoint(tmp_path / "r" / "checkpoint.pt")["feature_norm"]
    assert state["kind"] == "datanorm" and torch.equal(
        state["mean"], trainer.built.feature_normalizer.stats.mean
    )
    loaded = Trainer.load(tmp_path / "r")
    assert torch.equal(
        loaded.built.feature_normalizer.stats.var, trainer.built.feature_normalizer.stats.var
    )
    assert torch.equal(loaded.data.x_test, trainer.data.x_test)
    assert main(["eval", str(tmp_path / "r"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert result["test_accuracy"] == summary["test_accuracy"] and result[
        "epsilon"
    ] == pytest.approx(summary["epsilon"])


def test_groupnorm_features_and_bad_groups(tmp_path):
    trainer = Trainer.create(
        scatter_config(tmp_path / "g", "features.normalize=groupnorm", "features.groups=9"),
        progress=False,
    )
    x = trainer.data.x_train[:50].reshape(50, 9, -1)
    assert torch.allclose(x.mean(-1), torch.zeros(50, 9), atol=1e-4)
    assert trainer.data.info.input_shape == (81, 7, 7)
    with pytest.raises(ConfigError, match="does not divide the 81"):
        Trainer.create(
            scatter_config(tmp_path / "bad", "features.normalize=groupnorm", "features.groups=10"),
            progress=False,
        )


def test_padded_scatternet_features_feed_a_model_of_their_shape(tmp_path):
    # 100 training images a class: this test's padded features are extracted for no other test
    cfg = scatter_config(
        tmp_path / "p",
        "features.normalize=groupnorm",
        "features.scatter_pad=2",
        "data.max_per_class=100",
    )
    trainer = Trainer.create(cfg, progress=False)
    assert trainer.data.info.input_shape == trainer.data.x_train.shape[1:] == (81, 8, 8)
    summary = trainer.run()
    assert summary["steps"] == 16 and 0 < summary["epsilon"] <= 3
    assert summary["test_accuracy"] > 0.5  # 16 steps on 81x8x8 features learn (chance is 0.1)


def test_target_below_the_release_cost_is_a_clear_error(tmp_path):
    cfg = scatter_config(
        tmp_path / "r", "features.normalize=datanorm", "features.norm_noise=1", "dp.epsilon=1"
    )
    with pytest.raises(ConfigError, match="data-norm alone spends"):
        Trainer.create(cfg, progress=False)


def test_preset_runs_through_the_cli(tmp_path):
    # The MNIST ScatterNet+linear preset on the embedded sample (no data.root needed), shortened.
    code = main(
        [
            "train",
            "preset:tramer-mnist-scatter-linear",
            "--quiet",
            "--set",
            "data.name=mnist-5k",
            "--set",
            "train.epochs=2",
            "--set",
            "dp.batch_size=1000",
            "--set",
            f"run.out_dir={tmp_path / 'p'}",
        ]
    )
    assert code == 0
    summary = json.loads((tmp_path / "p" / "summary.json").read_text())
    assert (
        summary["model"] == "scatter-linear"
        and summary["epsilon"] <= 3.0
        and summary["accountant"] == "rdp"
    )
    records = [
        json.loads(line) for line in (tmp_path / "p" / "metrics.jsonl").read_text().splitlines()
    ]
    # one per epoch
    assert len(records) == 2 and all("epsilon" in r and "test_accuracy" in r for r in records)
    assert records[0]["epsilon"] < records[1]["epsilon"]


def test_linear_probe_on_penultimate_features_of_a_model(tmp_path):
    # Tramer Section 5.2 style: a linear model on a (here randomly initialised, seeded) model's
    # penultimate features; the features are 1-D, normalised per example in 8 groups.
    cfg = load_config(
        None,
        [
            f"run.out_dir={tmp_path / 'probe'}",
            "run.seed=0",
            "train.steps=4",
            "dp.batch_size=500",
            "features.extractor=model:papernot-cnn",
            "features.normalize=groupnorm",
            "features.groups=8",
            "model.name=linear",
        ],
    )
    trainer = Trainer.create(cfg, progress=False)
    assert trainer.data.info.input_shape == (512,) and trainer.data.x_train.shape == (4000, 512)
    summary = trainer.run()
    assert summary["trainable_params"] == 512 * 10 + 10 and summary["epsilon"] <= 3.0


def test_a_checkpoint_without_its_released_statistics_is_refused(tmp_path):
    from dpscale._io import save_checkpoint

    cfg = scatter_config(
        tmp_path / "r", "features.normalize=datanorm", "features.norm_clip=[0.2, 0.05]"
    )
    Trainer.create(cfg, progress=False).run(max_steps=2)
    state = load_checkpoint(tmp_path / "r" / "checkpoint.pt")
    # drawing new statistics on resume would be a second, unaccounted release
    del state["feature_norm"]
    state.pop("format")
    save_checkpoint(tmp_path / "r" / "checkpoint.pt", state)
    with pytest.raises(ConfigError, match="feature normalisation"):
        Trainer.resume(tmp_path / "r", progress=False)


def test_centred_run_composes_its_release_and_subtracts_a_mean_of_the_right_noise(tmp_path, capsys):
    cfg = scatter_config(
        tmp_path / "c",
        "features.normalize=groupnorm",
        "features.groups=27",
        "features.center=true",
        "features.center_noise=8",
    )
    trainer = Trainer.create(cfg, progress=False)
    release = AccountingSegment(1.0, 8.0, 1, "feature-mean")
    assert trainer.plan.releases == (release,) and trainer.mechanism.accountant.releases == (
        release,
    )
    summary = trainer.run()
    sigma = summary["noise_multiplier"]
    composed = compute_epsilon(
        sample_rate=500 / 4000,
        noise_multiplier=sigma,
        steps=16,
        delta=1e-5,
        kind="rdp",
        releases=(release,),
    )
    assert summary["epsilon"] == pytest.approx(composed) and composed <= 3.0
    assert (
        set(summary["epsilon_parts"]) == {"feature-mean", "dp-sgd"}
        and summary["feature_centering"] is True
    )
    plain = Trainer.create(
        scatter_config(tmp_path / "g", "features.normalize=groupnorm", "features.groups=27"),
        progress=False,
    )
    assert plain.plan.noise_multiplier < sigma  # calibration paid for the release
    # `dpscale account --feature-mean-noise` calibrates the same sigma as the run.
    capsys.readouterr()
    assert (
        main(
            [
                "account",
                "--dataset-size",
                "4000",
                "--batch-size",
                "500",
                "--steps",
                "16",
                "--target-epsilon",
                "3",
                "--accountant",
                "rdp",
                "--feature-mean-noise",
                "8",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["noise_multiplier"] == pytest.approx(sigma, rel=1e-9)
    # The inputs are GroupNorm minus the released mean; that mean is the exact one (R = sqrt(d) clips
    # nothing after GroupNorm) plus noise of std sigma_c R / N per feature.
    center = trainer.built.feature_normalizer.center
    grouped = plain.data.x_train.double()  # the same features, GroupNorm only
    assert torch.allclose(trainer.data.x_train.double(), grouped - center, atol=1e-5)
    d, n = center.numel(), grouped.shape[0]
    noise = (center - grouped.mean(0)).flatten()
    expected_std = 8.0 * d**0.5 / n
    assert float(noise.std()) == pytest.approx(expected_std, rel=0.1)  # 3969 normals: within 10%
    # a mean worth removing at this N
    assert float(grouped.mean(0).norm()) > 3 * float(noise.norm())


def test_centring_is_checkpointed_reused_and_cannot_be_added_or_dropped_on_resume(tmp_path):
    cfg = scatter_config(
        tmp_path / "c", "features.normalize=groupnorm", "features.groups=27", "features.center=true"
    )
    trainer = Trainer.create(cfg, progress=False)
    trainer.run(max_steps=2)
    state = load_checkpoint(tmp_path / "c" / "checkpoint.pt")["feature_norm"]
    assert torch.equal(state["center"], trainer.built.feature_normalizer.center)
    # loaded again: the same mean, not a new draw
    resumed = Trainer.resume(tmp_path / "c", progress=False)
    assert torch.equal(resumed.built.feature_normalizer.center, state["center"])
    assert resumed.plan.releases == trainer.plan.releases and torch.equal(
        resumed.data.x_test, trainer.data.x_test
    )
    resumed.close()
    # Refused (by the DP plan's releases, or by the normaliser's own check in a non-private run).
    with pytest.raises(ConfigError, match="feature-mean|features.center is false"):
        Trainer.resume(tmp_path / "c", progress=False, overrides=["features.center=false"])
    plain = scatter_config(tmp_path / "p", "features.normalize=groupnorm", "features.groups=27")
    Trainer.create(plain, progress=False).run(max_steps=2)
    with pytest.raises(ConfigError, match="feature-mean|holds no released feature mean"):
        Trainer.resume(tmp_path / "p", progress=False, overrides=["features.center=true"])


def test_exact_centring_of_a_private_run_is_refused():
    with pytest.raises(ConfigError, match="center_noise=0 subtracts the exact mean"):
        load_config(
            None,
            [
                "features.extractor=scatternet",
                "features.normalize=groupnorm",
                "features.center=true",
                "features.center_noise=0",
            ],
        )
    with pytest.raises(ConfigError, match="center_clip must be a positive"):
        load_config(None, ["features.center=true", "features.center_clip=0"])


def test_non_private_runs_cannot_add_or_drop_centring_on_resume_either(tmp_path):
    # Without noise there is no release in the plan to compare: the normaliser's check refuses.
    cfg = scatter_config(
        tmp_path / "n",
        "features.normalize=groupnorm",
        "features.groups=27",
        "features.center=true",
        "dp.noise_multiplier=0",
        "dp.epsilon=null",
        "features.center_noise=0",
    )
    Trainer.create(cfg, progress=False).run(max_steps=2)
    with pytest.raises(ConfigError, match="features.center is false"):
        Trainer.resume(tmp_path / "n", progress=False, overrides=["features.center=false"])

"""Transfer from public weights: ``dpscale pretrain``, ``model.init`` (+ ``reset_head``), frozen groups."""

import json

import pytest
import torch

from dpscale.cli import main
from dpscale.config import load_config
from dpscale.errors import ConfigError
from dpscale.models import build_model
from dpscale.models.init import init_from
from dpscale.train.loop import Trainer

SMALL = [
    "model.kwargs={filters: [4, 4]}",
    "train.steps=3",
    "dp.batch_size=64",
    "train.max_physical_batch_size=64",
]
# The source below trained on the same data as the private runs: declared public (tests/test_init_privacy.py
# covers what happens otherwise).
PUBLIC = "model.init_public=true"


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A non-private run on the embedded MNIST sample (the "public" source here)."""
    out = tmp_path_factory.mktemp("pre") / "run"
    args = [
        "pretrain",
        "--quiet",
        *sum((["--set", o] for o in SMALL), []),
        "--set",
        f"run.out_dir={out}",
    ]
    assert main(args) == 0
    return out


def test_pretrain_is_a_labelled_non_private_run(pretrained, capsys):
    summary = json.loads((pretrained / "summary.json").read_text())
    assert summary["private"] is False and summary["privacy_status"] == "epsilon=inf (NOT PRIVATE)"
    assert summary["noise_multiplier"] == 0 and summary["max_grad_norm"] is None
    with pytest.raises(ConfigError, match="trains without privacy"):
        from dpscale.cli import build_parser
        from dpscale.cli.train import _cmd_pretrain

        _cmd_pretrain(build_parser().parse_args(["pretrain", "--set", "dp.epsilon=3"]))


def test_init_loads_by_name_and_shape_with_a_fresh_head(pretrained, tmp_path):
    source = torch.load(pretrained / "checkpoint.pt", weights_only=True)["model"]
    config = load_config(
        None,
        [
            *SMALL,
            f"model.init={pretrained}",
            PUBLIC,
            "model.reset_head=true",
            "dp.epsilon=null",
            "dp.noise_multiplier=1.0",
            f"run.out_dir={tmp_path / 'private'}",
        ],
    )
    trainer = Trainer.create(config, progress=False)
    state = trainer.model.state_dict()
    for name in ("features.0.weight", "features.3.bias", "head.0.weight"):
        assert torch.equal(state[name], source[name]), name
    # the logits layer is fresh
    assert not torch.equal(state["head.2.weight"], source["head.2.weight"])
    summary = trainer.run()
    assert (
        summary["model_init"]["source"] == str(pretrained) and summary["model_init"]["loaded"] == 6
    )
    assert summary["model_init"]["reset_head"] == ["head.2.bias", "head.2.weight"]
    [note] = summary["guarantee_caveats"]
    assert (
        note.startswith(f"model.init_public: the init run {pretrained}")
        and "not included in epsilon" in note
    )


def test_init_then_frozen_groups_stay_bit_unchanged_and_out_of_the_clipping(pretrained, tmp_path):
    config = load_config(
        None,
        [
            *SMALL,
            f"model.init={pretrained}",
            PUBLIC,
            "model.freeze_groups=2",
            "dp.epsilon=null",
            "dp.noise_multiplier=1.0",
            f"run.out_dir={tmp_path / 'frozen'}",
        ],
    )
    trainer = Trainer.create(config, progress=False)
    frozen = {
        n: p.detach().clone()
        for n, p in trainer.model.named_parameters()
        if n.startswith("features.")
    }
    assert not any(
        p.requires_grad for n, p in trainer.model.named_parameters() if n.startswith("features.")
    )
    trainer.run()
    for name, before in frozen.items():
        assert torch.equal(dict(trainer.model.named_parameters())[name], before), name
    # the clipping norm covers only the trainable (head) parameters: a frozen layer adds nothing
    from dpscale.privacy.clipping.per_example import trainable_params

    assert set(trainable_params(trainer.model)) == {
        "head.0.weight",
        "head.0.bias",
        "head.2.weight",
        "head.2.bias",
    }


def test_a_mismatched_source_is_refused_with_the_list(pretrained, tmp_path):
    other = build_model("papernot-cnn", 10, (1, 28, 28), "tanh", filters=[8, 4])
    with pytest.raises(
        ConfigError, match=r"features\.0\.weight: source \(4, 1, 8, 8\) vs model \(8, 1, 8, 8\)"
    ) as err:
        init_from(other, str(pretrained))
    assert "features.0.bias: source (4,) vs model (8,)" in str(err.value)
    five = build_model("papernot-cnn", 5, (1, 28, 28), "tanh", filters=[4, 4])
    with pytest.raises(
        ConfigError,
        match=r"reset_head: true\): head\.2\.weight: source \(10, 32\) vs model \(5, 32\)",
    ):
        init_from(five, str(pretrained))
    assert init_from(five, str(pretrained), reset_head=True).loaded == 6
    torch.save({"model": {"features.0.weight": torch.zeros(4, 1, 8, 8)}}, tmp_path / "partial.pt")
    with pytest.raises(ConfigError, match="features.0.bias: not in the source"):
        init_from(five, str(tmp_path / "partial.pt"), reset_head=True)
    with pytest.raises(ConfigError, match="no such run directory"):
        init_from(five, str(tmp_path / "nothing"))
    with pytest.raises(ConfigError, match="model.reset_head re-initialises"):
        load_config(None, ["model.reset_head=true"])


def test_a_resumed_run_keeps_its_weights_and_its_init_record(pretrained, tmp_path):
    out = tmp_path / "cut"
    config = load_config(
        None,
        [
            *SMALL,
            f"model.init={pretrained}",
            PUBLIC,
            "dp.epsilon=null",
            "dp.noise_multiplier=1.0",
            f"run.out_dir={out}",
        ],
    )
    first = Trainer.create(config, progress=False)
    first.run(max_steps=1)
    weights = {k: v.clone() for k, v in first.model.state_dict().items()}
    resumed = Trainer.resume(out, progress=False)
    for name, value in weights.items():
        assert torch.equal(resumed.model.state_dict()[name], value), name
    assert resumed.built.init_report["source"] == str(pretrained)
    assert (
        resumed.plan.init_run == first.plan.init_run
        and resumed.plan.init_run.case == "declared public"
    )


# ----- class subsets and meta-classes (source variants) -----


def test_meta_classes_are_balanced_and_seeded():
    from dpscale.data.subsets import meta_class_map

    mapping = meta_class_map(100, 7, seed=3)
    sizes = torch.bincount(torch.from_numpy(mapping), minlength=7)
    assert sizes.max() - sizes.min() <= 1 and sizes.sum() == 100
    assert (meta_class_map(100, 7, seed=3) == mapping).all()
    assert not (meta_class_map(100, 7, seed=4) == mapping).all()


def test_class_subsets_relabel_cap_and_shrink_n():
    from dpscale.data import load_dataset
    from dpscale.data.subsets import random_classes, select

    data = load_dataset("mnist-5k")
    kept = select(data, classes=[3, 1])
    counts = {c: int((data.y_train == c).sum()) for c in (1, 3)}
    assert kept.info.num_train == counts[1] + counts[3] and kept.info.num_classes == 2
    # relabelled in the order given: 3 -> 0, 1 -> 1
    assert int((kept.y_train == 0).sum()) == counts[3]
    assert torch.equal(kept.x_train[kept.y_train == 0], data.x_train[data.y_train == 3])
    assert kept.info.num_test == int((data.y_test == 1).sum() + (data.y_test == 3).sum())
    capped = select(data, max_per_class=50, seed=1)
    assert (
        torch.bincount(capped.y_train).tolist() == [50] * 10
        and capped.info.num_test == data.info.num_test
    )
    assert torch.equal(select(data, max_per_class=50, seed=1).x_train, capped.x_train)
    assert (
        random_classes(100, 10, seed=2)
        == random_classes(100, 10, seed=2)
        != random_classes(100, 10, seed=5)
    )
    grouped = select(data, meta_classes=3, seed=0)
    assert grouped.info.num_classes == 3 and set(grouped.y_train.tolist()) == {0, 1, 2}


def test_a_private_run_on_a_class_subset_accounts_for_the_subset(tmp_path):
    config = load_config(
        None,
        [*SMALL, "data.classes=[5, 6, 7, 8, 9]", "dp.epsilon=2.0", f"run.out_dir={tmp_path / 'r'}"],
    )
    trainer = Trainer.create(config, progress=False)
    from dpscale.data import load_dataset

    full = load_dataset("mnist-5k")
    expected_n = int(sum((full.y_train == c).sum() for c in range(5, 10)))
    assert trainer.plan.dataset_size == expected_n and trainer.plan.sample_rate == 64 / expected_n
    assert trainer.model.head[2].out_features == 5
    with pytest.raises(ConfigError, match="need data.loader=memory"):
        load_config(
            None,
            ["data.name=imagefolder", "data.root=/x", "data.loader=stream", "data.classes=[1]"],
        )


# ----- Mean-Var init: statistics of a seed model, a release composed into epsilon -----

PRIVATE = ["dp.epsilon=null", "dp.noise_multiplier=1.0"]


@pytest.fixture(scope="module")
def private_seed(tmp_path_factory):
    out = tmp_path_factory.mktemp("seed") / "run"
    trainer = Trainer.create(
        load_config(None, [*SMALL, *PRIVATE, f"run.out_dir={out}"]), progress=False
    )
    trainer.run()
    return out


def _meanvar_config(seed_dir, out, *extra):
    return load_config(
        None,
        [
            *SMALL,
            *PRIVATE,
            "model.init_scaling=meanvar",
            f"model.init_seed_model={seed_dir}",
            f"run.out_dir={out}",
            *extra,
        ],
    )


def test_meanvar_draws_each_layer_with_the_seed_layers_mean_and_variance(private_seed, tmp_path):
    seed = torch.load(private_seed / "checkpoint.pt", weights_only=True)["model"]
    trainer = Trainer.create(_meanvar_config(private_seed, tmp_path / "mv"), progress=False)
    assert trainer.built.init_report["scaled"] == 8 and trainer.built.init_report["kept"] == 0
    for name, param in trainer.model.named_parameters():
        source = seed[name].double()
        if source.numel() < 256:
            continue
        n, mean, std = param.numel(), source.mean(), source.std(unbiased=False)
        drawn = param.detach().double()
        assert abs(drawn.mean() - mean) < 5 * std / n**0.5, name
        assert abs(drawn.std(unbiased=False) / std - 1) < 5 * (2 / n) ** 0.5, name
        assert not torch.equal(drawn, source)  # drawn, not copied


def test_meanvar_composes_the_seed_runs_epsilon(private_seed, tmp_path):
    from dataclasses import replace

    from dpscale.privacy.accounting.accountant import PrivacyAccountant

    trainer = Trainer.create(_meanvar_config(private_seed, tmp_path / "mv"), progress=False)
    summary = trainer.run()
    seed_history = torch.load(private_seed / "checkpoint.pt", weights_only=False)["mechanism"][
        "accountant"
    ]
    reference = PrivacyAccountant(trainer.plan.accountant)
    for segment in PrivacyAccountant.from_state_dict(seed_history).history:
        reference.record(replace(segment, label=f"init-seed-run:{segment.label}"))
    for _ in range(trainer.step):
        reference.step(
            sample_rate=trainer.plan.sample_rate, noise_multiplier=trainer.plan.noise_multiplier
        )
    assert summary["epsilon"] == pytest.approx(reference.epsilon(trainer.plan.delta), rel=1e-12)
    alone = json.loads((private_seed / "summary.json").read_text())["epsilon"]
    assert summary["epsilon"] > alone and "init-seed-run:dp-sgd" in summary["epsilon_parts"]


def test_meanvar_from_a_non_private_seed_needs_it_declared_public(pretrained, tmp_path):
    with pytest.raises(ConfigError, match="trained without privacy"):
        Trainer.create(_meanvar_config(pretrained, tmp_path / "a"), progress=False)
    trainer = Trainer.create(
        _meanvar_config(pretrained, tmp_path / "b", "model.init_seed_public=true"), progress=False
    )
    assert trainer.plan.releases == ()
    assert any("init_seed_public" in w for w in trainer.privacy_warnings())


def test_timm_sources_say_clearly_when_timm_does_not_import():
    try:
        import timm  # noqa: F401
    except Exception:  # the CPU torch of CI: timm does not import
        model = build_model("papernot-cnn", 10, (1, 28, 28), "tanh", filters=[4, 4])
        with pytest.raises(
            ConfigError, match="model.init=timm:resnet18: timm does not import here"
        ):
            init_from(model, "timm:resnet18")
    else:
        pytest.skip("timm imports here: the error path is not reachable")


@pytest.mark.parametrize("key", ["model.init_seed_model", "features.extractor"])
def test_a_mistyped_source_run_is_a_one_line_user_error(tmp_path, key, capsys):
    """Issue 46: a path that is no run directory exits 2 with one line naming the key, no traceback."""
    missing = tmp_path / "no-such-run"
    value = f"checkpoint:{missing}" if key == "features.extractor" else str(missing)
    extra = ["--set", "model.init_scaling=meanvar"] if key == "model.init_seed_model" else []
    code = main(
        [
            "train",
            "--quiet",
            "--set",
            f"run.out_dir={tmp_path / 'run'}",
            "--set",
            f"{key}={value}",
            "--set",
            "train.steps=1",
            "--set",
            "train.epochs=null",
            *extra,
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "not a dpscale run directory" in err
    assert len(err.strip().splitlines()) == 1

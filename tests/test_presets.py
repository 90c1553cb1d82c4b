"""Paper presets: they load, validate, build, and hold the paper's numbers."""

import json

import pytest
import yaml

from dpscale.cli import main
from dpscale.config import load_config
from dpscale.errors import ConfigError
from dpscale.features import scatter_output_shape
from dpscale.models import build_model
from dpscale.presets import get_preset, list_presets

FEATURE_SHAPES = {"mnist": (1, 28, 28), "fashion-mnist": (1, 28, 28), "cifar10": (3, 32, 32)}


def _preset_model(config):
    """The preset's model, built for its data's images (or their ScatterNet features)."""
    shape = FEATURE_SHAPES.get(config.data.name, (1, 28, 28))
    if config.features.extractor == "scatternet":
        shape = scatter_output_shape(shape, pad=config.features.scatter_pad)
    return build_model(config.model.name, 10, shape, config.model.activation, **config.model.kwargs)


@pytest.mark.parametrize("name", [p.name for p in list_presets()])
def test_every_preset_loads_and_its_model_builds(name):
    config = load_config(f"preset:{name}")
    model = _preset_model(config)
    assert model is not None
    assert get_preset(name).source and get_preset(name).description


# (preset, batch size, lr = base x B / 512, epochs, normalize, groups, norm_noise, norm_clip)
TABLE_13 = [
    ("tramer-mnist-scatter-linear", 4096, 8.0, 40, "datanorm", None, 8.0, (0.2, 0.05)),
    ("tramer-mnist-scatter-cnn", 1024, 1.0, 25, "datanorm", None, 8.0, (0.2, 0.05)),
    ("tramer-mnist-cnn", 512, 0.5, 40, "none", None, None, None),
    ("tramer-fmnist-scatter-linear", 8192, 16.0, 40, "groupnorm", 27, None, None),
    ("tramer-fmnist-scatter-cnn", 2048, 4.0, 40, "groupnorm", 27, None, None),
    ("tramer-fmnist-cnn", 2048, 4.0, 40, "none", None, None, None),
    ("tramer-cifar10-scatter-linear", 8192, 4.0, 60, "datanorm", None, 8.0, (1.0, 1.5)),
    ("tramer-cifar10-scatter-cnn", 8192, 4.0, 60, "datanorm", None, 8.0, (1.0, 1.5)),
    ("tramer-cifar10-cnn", 1024, 1.0, 30, "none", None, None, None),
]


@pytest.mark.parametrize("row", TABLE_13, ids=[r[0] for r in TABLE_13])
def test_tramer_presets_hold_table_13(row):
    name, batch, lr, epochs, normalize, groups, noise, clip = row
    c = load_config(f"preset:{name}")
    assert (c.dp.batch_size, c.optim.lr, c.train.epochs) == (batch, lr, epochs)
    assert (c.dp.epsilon, c.dp.delta, c.dp.max_grad_norm, c.optim.momentum) == (3.0, 1e-5, 0.1, 0.9)
    assert (
        c.dp.noise_multiplier is None
        and c.dp.sampling == "poisson"
        and c.model.activation == "tanh"
    )
    assert c.features.normalize == normalize and c.train.eval_every_epochs == 1
    if groups:
        assert c.features.groups == groups
    if noise:
        assert (c.features.norm_noise, c.features.norm_clip) == (noise, clip)
    assert (c.features.extractor == "scatternet") == ("scatter" in name)
    expected_model = (
        name.split("-", 2)[2]
        if "scatter" in name
        else ("tramer-cifar-cnn" if "cifar" in name else "papernot-cnn")
    )
    assert c.model.name == expected_model


DPSCALE_FMNIST = [
    "dpscale-fmnist-scatter-linear",
    "dpscale-fmnist-scatter-cnn",
    "dpscale-fmnist-cnn",
]


@pytest.mark.parametrize("name", DPSCALE_FMNIST)
def test_dpscale_fmnist_recipes_spend_epsilon_3_and_name_their_model_size(name):
    """Issue 28's recipes: the privacy numbers of the issue, and the parameter count their text gives."""
    c = load_config(f"preset:{name}")
    assert (c.data.name, c.dp.epsilon, c.dp.delta, c.dp.sampling) == (
        "fashion-mnist",
        3.0,
        1e-5,
        "poisson",
    )
    # calibrated, and a real run
    assert c.dp.noise_multiplier is None and c.dp.simulated_batch_size is None
    assert c.dp.accountant == "pld"
    count = sum(p.numel() for p in _preset_model(c).parameters())
    assert f"({count:,} parameters)" in get_preset(name).description


OTHER_EPSILONS = [f"{name}-eps{eps}" for name in DPSCALE_FMNIST for eps in (1, 8)]


@pytest.mark.parametrize("name", OTHER_EPSILONS)
def test_epsilon_variants_change_only_epsilon_and_epochs(name):
    """Issue 47's presets at epsilon 1 and 8: the epsilon-3 recipe with only the budget and the number
    of epochs changed (so the recipe's two-step run below covers their code path)."""
    recipe, _, eps = name.rpartition("-eps")
    variant, base = (
        load_config(f"preset:{name}").to_dict(),
        load_config(f"preset:{recipe}").to_dict(),
    )
    assert variant["dp"]["epsilon"] == float(eps) and variant["train"]["epochs"] in (
        20,
        40,
        80,
        160,
    )
    for section in (variant["dp"], base["dp"]):
        del section["epsilon"]
    for section in (variant["train"], base["train"]):
        del section["epochs"]
    assert variant == base
    assert (
        f"epsilon={eps}, " in get_preset(name).description
        and "validation accuracy" in get_preset(name).source
    )


def test_overrides_apply_on_top_of_a_preset_and_presets_are_not_shared():
    c = load_config("preset:tramer-fmnist-cnn", ["dp.epsilon=1", "data.root=/data/fmnist"])
    assert (c.dp.epsilon, c.data.root, c.dp.batch_size) == (1.0, "/data/fmnist", 2048)
    get_preset("tramer-fmnist-cnn").values["dp"]["batch_size"] = 1
    assert load_config("preset:tramer-fmnist-cnn").dp.batch_size == 2048


def test_unknown_preset_suggests_close_names():
    with pytest.raises(ConfigError, match="did you mean|Did you mean tramer-fmnist-cnn"):
        load_config("preset:tramer-fmnist-cn")


def test_presets_command_lists_and_prints_loadable_yaml(tmp_path, capsys):
    assert main(["presets"]) == 0
    listing = capsys.readouterr().out
    assert all(p.name in listing for p in list_presets())
    assert main(["presets", "tramer-cifar10-scatter-cnn"]) == 0
    text = capsys.readouterr().out
    (tmp_path / "c.yaml").write_text(text)
    assert load_config(tmp_path / "c.yaml") == load_config("preset:tramer-cifar10-scatter-cnn")
    assert "Table 13" in text and yaml.safe_load(text)["features"]["norm_noise"] == 8.0
    assert main(["presets", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == len(list_presets())
    assert main(["presets", "nope"]) == 2


# ----- every new preset runs two steps on generated data of the right shape -----


def _generated_root(kind, tmp_path):
    """A tiny dataset in the format the preset's data.name reads (images of the real shape)."""
    import numpy as np

    from datafiles import make_cifar10, write_idx
    from datafiles import write_image_folder as _write_folder

    if kind == "cifar10":
        make_cifar10(tmp_path / "cifar-10-batches-py")  # 15 train, 4 test: 32x32x3
        return tmp_path
    if kind == "cifar100":
        from datafiles import write_batch

        base = tmp_path / "cifar-100-python"
        base.mkdir(parents=True)
        write_batch(base / "train", 400, b"fine_labels", 100, 1)
        write_batch(base / "test", 40, b"fine_labels", 100, 2)
        return tmp_path
    if kind == "fashion-mnist":
        rng = np.random.default_rng(0)
        write_idx(tmp_path / "train-images-idx3-ubyte", rng.integers(0, 256, (40, 28, 28)))
        write_idx(tmp_path / "train-labels-idx1-ubyte", np.arange(40) % 10)
        return tmp_path
    # resized to 224 by the preset
    return _write_folder(tmp_path / "images", per_class=8, size=40, classes=3)


# Small batches for the generated sets (N is tens of images); everything else is the preset's.
RUN_OVERRIDES = {
    "papernot-fmnist-tanh": ["dp.batch_size=8"],
    "papernot-cifar10-tanh": ["dp.batch_size=4"],
    "tan-cifar10-wrn16-4-augmult": ["dp.batch_size=4", "train.max_physical_batch_size=32"],
    "tan-cifar10-wrn16-4-augmult-sim512": [
        "dp.batch_size=4",
        "dp.simulated_batch_size=2",
        "train.max_physical_batch_size=32",
    ],
    # its stand-in source (below) trained, without noise, on these very generated images: declared public
    "kurakin-imagenet-resnet18-gn": [
        "dp.batch_size=4",
        "train.max_physical_batch_size=4",
        "model.init_public=true",
    ],
    "kurakin-imagenet-resnet50-gn": ["dp.batch_size=2", "train.max_physical_batch_size=2"],
    "tan-imagenet-nf-resnet50": ["dp.batch_size=2", "train.max_physical_batch_size=8"],
    "tan-imagenet-nf-resnet50-sim256": [
        "dp.batch_size=2",
        "dp.simulated_batch_size=1",
        "train.max_physical_batch_size=8",
    ],
    "papernot-cifar100-source-min-rand-10": ["dp.batch_size=8"],
    "papernot-cifar100-source-half-rand-50": ["dp.batch_size=8"],
    "papernot-cifar100-source-max-100": ["dp.batch_size=8"],
    "papernot-cifar10-transfer": ["dp.batch_size=4"],
    "tramer-cifar10-linear-probe": ["dp.batch_size=4"],
    "dpscale-fmnist-scatter-linear": ["dp.batch_size=8"],
    "dpscale-fmnist-scatter-cnn": ["dp.batch_size=8"],
    "dpscale-fmnist-cnn": ["dp.batch_size=8"],
}
# Targets start from a source run: (source preset or model, data kind, the override naming it)
SOURCES = {
    "papernot-cifar10-transfer": ("papernot-cifar100-source-max-100", "cifar100", "model.init={}"),
    "tramer-cifar10-linear-probe": (
        "papernot-cifar100-source-max-100",
        "cifar100",
        "features.extractor=checkpoint:{}",
    ),
    "kurakin-imagenet-resnet18-gn": ("resnet18-gn", "imagefolder", "model.init={}"),
}


def _source_run(name, tmp_path):
    """A short non-private source run for a target preset (``dpscale pretrain``); the override naming it."""
    source, kind, override = SOURCES[name]
    root, out = _generated_root(kind, tmp_path / "source-data"), tmp_path / "source-run"
    if "-source-" in source:  # one of the paper's source presets
        head, sets = [f"preset:{source}"], ["dp.batch_size=8"]
    else:  # a Places365 stand-in: the target's architecture on the same generated images, in another folder
        head = []
        sets = [
            f"model.name={source}",
            "model.kwargs={norm_groups: 32, stem: imagenet}",
            "model.activation=relu",
            "data.name=imagefolder",
            "data.image_size=224",
            "dp.batch_size=2",
            "train.max_physical_batch_size=2",
        ]
    args = [
        "pretrain",
        *head,
        "--quiet",
        "--set",
        f"data.root={root}",
        "--set",
        "train.steps=2",
        "--set",
        f"run.out_dir={out}",
        "--set",
        "data.workers=0",
    ]
    for item in sets:
        args += ["--set", item]
    assert main(args) == 0
    return override.format(out)


# 224-px ResNets at K views take minutes of CPU (resnet18-gn: 12 s for two steps): in `make test-all`. So do the WRN-16-4 TAN presets
# (K=16 views, 28 s for two steps): their model at K views is checked against the per-example loop in
# test_augmult, and TAN simulations train in the default suite on small models (test_tune's
# dp.simulated_batch_size runs and sweeps, test_tan_plan_inputs).
HEAVY = {
    "kurakin-imagenet-resnet50-gn",
    "tan-imagenet-nf-resnet50",
    "tan-imagenet-nf-resnet50-sim256",
    "tan-cifar10-wrn16-4-augmult-sim512",
    "tan-cifar10-wrn16-4-augmult",
    "kurakin-imagenet-resnet18-gn",
}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY else n for n in RUN_OVERRIDES]
)
def test_new_presets_run_two_steps_on_generated_data(name, tmp_path):
    preset = get_preset(name)
    root = _generated_root(preset.values["data"]["name"], tmp_path)
    argv = [
        "train",
        f"preset:{name}",
        "--quiet",
        "--set",
        f"data.root={root}",
        "--set",
        "train.steps=2",
        "--set",
        f"run.out_dir={tmp_path / 'run'}",
        "--set",
        "data.workers=0",
    ]
    for override in RUN_OVERRIDES[name] + (
        [_source_run(name, tmp_path)] if name in SOURCES else []
    ):
        argv += ["--set", override]
    assert main(argv) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2
    if preset.values["data"]["name"] == "imagefolder":
        assert summary["dataset"] == "imagefolder"
        config = load_config(f"preset:{name}")
        assert config.data.image_size == 224  # the paper's input size


def test_every_preset_is_covered_by_a_run_test_or_an_older_one():
    older = {p for p in (r[0] for r in TABLE_13)} | {"papernot-mnist-tanh"}
    assert all(name in RUN_OVERRIDES for name in SOURCES)
    assert {p.name for p in list_presets()} == older | set(RUN_OVERRIDES) | set(OTHER_EPSILONS)

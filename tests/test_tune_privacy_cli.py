"""The TAN privacy commands: ``tan privacy-search`` (and the configs it writes), ``tan wall``,
``tan data-size``, and the privacy-wall warning of ``account`` and ``train``."""

import json
import math

import pytest

from dpscale.cli import main
from dpscale.config import load_config
from helpers import TINY_RUN_SETS, set_flags


def test_privacy_search_cli_json_and_configs(tmp_path, capsys):
    args = [
        "tan",
        "privacy-search",
        "--dataset-size",
        "50000",
        "--batch-size",
        "1000",
        "--noise",
        "3",
        "--steps",
        "400",
        "--accountant",
        "rdp",
    ]
    assert main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["steps"] for r in rows] == [100, 200, 400, 800, 1600]
    assert set(rows[0]) == {
        "batch_size",
        "steps",
        "noise_multiplier",
        "epsilon",
        "eps_tan",
        "lr_scale",
    }
    eta = lambda r: r["batch_size"] / 50000 * math.sqrt(r["steps"]) / r["noise_multiplier"]  # noqa: E731
    assert all(eta(r) == pytest.approx(eta(rows[2]), rel=1e-13) for r in rows)
    # ready configs: one per pair the trainer accepts (here: within the config's budget), for the
    # embedded MNIST sample (N = 4000)
    args = [
        "tan",
        "privacy-search",
        "--dataset-size",
        "4000",
        "--batch-size",
        "200",
        "--noise",
        "3",
        "--steps",
        "400",
        "--accountant",
        "rdp",
    ]
    assert main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    budget = rows[2]["epsilon"] + 1e-9
    base_sets = [
        "--set",
        "dp.accountant=rdp",
        "--set",
        f"dp.epsilon={budget}",
        "--set",
        "optim.lr=0.5",
    ]
    assert (
        main(
            [
                *args,
                "--config",
                "preset:papernot-mnist-tanh",
                "--set",
                "data.name=mnist-5k",
                *base_sets,
                "--out",
                str(tmp_path / "pairs"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    written = sorted((tmp_path / "pairs").glob("*.yaml"))
    within = [r for r in rows if r["epsilon"] <= budget]
    assert len(written) == len(within) >= 1 and "no config written: dp.noise_multiplier=3" in out
    config = load_config(tmp_path / "pairs" / f"pair-S{within[0]['steps']}.yaml")
    base = load_config("preset:papernot-mnist-tanh", ["optim.lr=0.5"])
    assert config.dp.batch_size == pytest.approx(within[0]["batch_size"], rel=1e-15)
    assert config.train.steps == within[0]["steps"] and config.dp.noise_multiplier == 3
    assert config.optim.lr == pytest.approx(base.optim.lr * within[0]["lr_scale"])
    # a --config that describes another run is refused
    assert (
        main(
            [
                *args,
                "--config",
                "preset:papernot-mnist-tanh",
                "--set",
                "data.name=mnist-5k",
                "--set",
                "dp.delta=1e-6",
                "--out",
                str(tmp_path / "other"),
            ]
        )
        == 2
    )
    assert "must describe the same run" in capsys.readouterr().err


def test_account_and_train_warn_at_the_privacy_wall(tmp_path, capsys):
    assert (
        main(
            [
                "account",
                "--dataset-size",
                "50000",
                "--batch-size",
                "500",
                "--noise",
                "0.8",
                "--steps",
                "1000",
                "--accountant",
                "rdp",
            ]
        )
        == 0
    )
    assert "WARNING: privacy wall" in capsys.readouterr().out
    assert (
        main(
            [
                "account",
                "--dataset-size",
                "50000",
                "--batch-size",
                "2500",
                "--noise",
                "4",
                "--steps",
                "1000",
                "--accountant",
                "rdp",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["wall_warning"] is None
    out = tmp_path / "run"
    sets = set_flags(
        *TINY_RUN_SETS,
        "train.steps=3",
        "dp.epsilon=null",
        "dp.noise_multiplier=0.7",
        f"run.out_dir={out}",
    )
    assert main(["train", "--quiet", *sets]) == 0
    assert "WARNING: privacy wall" in capsys.readouterr().err  # once, when the run starts
    assert "privacy wall" in json.loads((out / "summary.json").read_text())["privacy_warnings"][0]


def test_wall_and_data_size_cli(tmp_path, capsys):
    png = tmp_path / "wall.png"
    assert (
        main(
            [
                "tan",
                "wall",
                "--epsilon-tan",
                "3",
                "--steps",
                "1000",
                "--sigmas",
                "0.7,4",
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "<- wall" in out and png.stat().st_size > 1000
    assert (
        main(
            [
                "tan",
                "data-size",
                "--dataset-size",
                "5000",
                "--batch-size",
                "4096",
                "--noise",
                "3",
                "--steps",
                "2500",
                "--delta",
                "1e-4",
                "--factors",
                "1,10",
                "--accountant",
                "rdp",
                "--json",
            ]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert rows[1]["dataset_size"] == 50000 and rows[1]["epsilon"] == pytest.approx(7.1, abs=0.05)


def test_privacy_search_writes_configs_for_fixed_size_batches_at_whole_batch_sizes(
    tmp_path, capsys
):
    """A fixed-size run's pairs at B = 400, 200, 100: configs with integer batch sizes (the search's
    float B was refused as 'needs an integer dp.batch_size, got 200.0')."""
    args = [
        "tan",
        "privacy-search",
        "--dataset-size",
        "4000",
        "--batch-size",
        "200",
        "--noise",
        "3",
        "--steps",
        "400",
        "--steps-factors",
        "0.25,1,4",
        "--accountant",
        "rdp",
    ]
    sets = [
        "--set",
        "data.name=mnist-5k",
        "--set",
        "dp.sampling=fixed",
        "--set",
        "dp.accountant=rdp",
        "--set",
        "dp.epsilon=1000",
    ]
    assert (
        main(
            [
                *args,
                "--config",
                "preset:papernot-mnist-tanh",
                *sets,
                "--out",
                str(tmp_path / "pairs"),
            ]
        )
        == 0
    )
    assert "no config written" not in capsys.readouterr().out
    configs = [load_config(path) for path in sorted((tmp_path / "pairs").glob("*.yaml"))]
    assert sorted(c.dp.batch_size for c in configs) == [100, 200, 400]
    assert all(isinstance(c.dp.batch_size, int) and c.dp.sampling == "fixed" for c in configs)

"""``tan simulate --dry-run`` and ``tan privacy-search --config`` work out a plan's N, steps and
releases as the Trainer does (issue 26): they used to read the raw dataset and leave out class
subsets, files that data.skip_corrupt leaves out, and a Mean-Var seed run's releases, so for such
configs they reported another N and epsilon than the run would spend."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from PIL import Image

from dpscale.cli import main
from dpscale.config import load_config
from dpscale.errors import ConfigError
from dpscale.data import load_dataset
from dpscale.privacy.plan.dp_plan import DPPlan
from dpscale.train.loop import Trainer

# Cheap: a small CNN, 3 steps (only the Mean-Var seed run trains), no engine self-check (a label, not
# a privacy number), an epsilon to calibrate sigma to.
SMALL = [
    "model.kwargs={filters: [4, 4]}",
    "train.steps=3",
    "dp.batch_size=64",
    "train.max_physical_batch_size=64",
    "train.self_check=false",
    "dp.accountant=rdp",
    "dp.epsilon=3",
]
SIMULATED_BATCH = 8
REFERENCE = re.compile(r"reference run:  B=(\S+), sigma=(\S+), S=(\d+), epsilon=(\S+) at delta")
SIMULATED = re.compile(r"simulated run:  B=(\S+), sigma=(\S+), S=(\d+) \(q/sigma=(\S+), eps_TAN")


def _sets(items: list[str]) -> list[str]:
    return [x for item in items for x in ("--set", item)]


def _image_folder_with_a_corrupt_file(root):
    """Two classes of 40 small PNGs, and one file that is no image."""
    rng = np.random.default_rng(0)
    for c in range(2):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(40):
            Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)).save(
                root / f"class{c}" / f"{i:02d}.png"
            )
    (root / "class1" / "broken.png").write_bytes(b"this is no image")
    return root


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, list[str]]:
    """Config overrides for each thing the raw dataset leaves out."""
    root = _image_folder_with_a_corrupt_file(tmp_path_factory.mktemp("folder") / "images")
    seed = tmp_path_factory.mktemp("seed") / "run"
    seed_run = ["dp.epsilon=null", "dp.noise_multiplier=1.0", f"run.out_dir={seed}"]
    # private: its releases count
    Trainer.create(load_config(None, [*SMALL, *seed_run]), progress=False).run()
    return {
        "class subset": [*SMALL, "data.classes=[5, 6, 7, 8, 9]"],
        "skip_corrupt": [
            *SMALL,
            "data.name=imagefolder",
            f"data.root={root}",
            "data.image_size=28",
            "data.skip_corrupt=true",
            "dp.batch_size=16",
            "train.max_physical_batch_size=16",
        ],
        "meanvar seed": [*SMALL, "model.init_scaling=meanvar", f"model.init_seed_model={seed}"],
    }


@pytest.fixture()
def defaults(tmp_path):
    """A config file that keeps every default (``--config`` needs one; the cases are --set on it)."""
    path = tmp_path / "defaults.yaml"
    path.write_text("{}\n")
    return str(path)


def _trainer_plan(sets: list[str], out_dir) -> DPPlan:
    """The plan ``Trainer.create`` makes for ``sets`` (nothing trained)."""
    trainer = Trainer.create(load_config(None, [*sets, f"run.out_dir={out_dir}"]), progress=False)
    trainer.close()
    return trainer.plan


@pytest.fixture(scope="module")
def trainer_plans(cases, tmp_path_factory) -> dict[str, DPPlan]:
    """The Trainer's plan of each case's TAN simulation (its N and steps are the reference run's too)."""
    simulated = f"dp.simulated_batch_size={SIMULATED_BATCH}"
    return {
        case: _trainer_plan([*sets, simulated], tmp_path_factory.mktemp("run") / "r")
        for case, sets in cases.items()
    }


def _raw_n(case: str) -> int | None:
    """The N the old code read: the whole embedded sample for the class subset; none at all for the
    folder (its raw listing has a file it cannot read); the Mean-Var seed run leaves N alone."""
    return load_dataset("mnist-5k").info.num_train if case == "class subset" else None


@pytest.mark.parametrize("case", ["class subset", "skip_corrupt", "meanvar seed"])
def test_simulate_dry_run_reports_the_trainers_plan(cases, trainer_plans, case, capsys):
    sets = cases[case]
    assert (
        main(["tan", "simulate", "--batch-size", str(SIMULATED_BATCH), "--dry-run", *_sets(sets)])
        == 0
    )
    out = capsys.readouterr().out
    ((_, sigma_ref, steps, epsilon),) = REFERENCE.findall(out)
    ((_, sigma, sim_steps, q_over_sigma),) = SIMULATED.findall(out)
    plan = trainer_plans[case]
    reference = plan.simulation
    assert int(steps) == int(sim_steps) == plan.steps
    assert (
        epsilon == f"{reference.epsilon:.4f}" and sigma_ref == f"{reference.noise_multiplier:.6g}"
    )
    assert (
        sigma == f"{plan.noise_multiplier:.6g}"
        and q_over_sigma == f"{plan.sample_rate / plan.noise_multiplier:.6g}"
    )
    # N
    assert SIMULATED_BATCH / (float(q_over_sigma) * float(sigma)) == pytest.approx(
        plan.dataset_size, rel=1e-4
    )
    # the seed run's releases are in the budget (sigma calibrated with them)
    if case == "meanvar seed":
        assert any(r.label.startswith("init-seed-run:") for r in plan.releases)
    if _raw_n(case) is not None:  # the raw dataset is not what the Trainer samples from
        assert plan.dataset_size < _raw_n(case)


@pytest.mark.parametrize("case", ["class subset", "skip_corrupt"])
def test_privacy_search_takes_the_trainers_n(
    cases, trainer_plans, case, defaults, tmp_path, capsys
):
    sets = cases[case]
    plan = trainer_plans[case]
    # skip_corrupt: as if the unreadable file counted
    wrong_n = _raw_n(case) or plan.dataset_size + 1
    search = [
        "tan",
        "privacy-search",
        "--batch-size",
        "16",
        "--noise",
        "3",
        "--steps",
        "40",
        "--accountant",
        "rdp",
        "--steps-factors",
        "1",
        "--config",
        defaults,
        *_sets(sets),
    ]
    assert main([*search, "--dataset-size", str(wrong_n), "--out", str(tmp_path / "raw")]) == 2
    assert (
        f"--dataset-size {wrong_n} but the config has {plan.dataset_size}"
        in capsys.readouterr().err
    )
    assert (
        main([*search, "--dataset-size", str(plan.dataset_size), "--out", str(tmp_path / "pairs")])
        == 0
    )
    assert len(list((tmp_path / "pairs").glob("pair-S*.yaml"))) == 1


def test_privacy_search_counts_the_seed_runs_releases_in_the_budget(
    cases, defaults, tmp_path, capsys
):
    # A budget that the pairs' DP-SGD steps alone meet but not with the seed run's releases: the
    # Trainer refuses every pair, so no config may be written for one.
    search = [
        "tan",
        "privacy-search",
        "--dataset-size",
        "4000",
        "--batch-size",
        "64",
        "--noise",
        "3",
        "--steps",
        "3",
        "--accountant",
        "rdp",
        "--steps-factors",
        "1,2",
        "--json",
    ]
    assert main(search) == 0
    alone = max(row["epsilon"] for row in _json_rows(capsys))
    sets = [*cases["meanvar seed"], f"dp.epsilon={alone * 1.001}"]
    assert (
        main([*search, "--config", defaults, *_sets(sets), "--out", str(tmp_path / "pairs")]) == 0
    )
    rows = _json_rows(capsys)
    assert [row["config"] for row in rows] == [None, None] and not list(
        (tmp_path / "pairs").glob("*.yaml")
    )
    # the first pair (factor 1), as the Trainer would take it
    pair = [*sets, "dp.noise_multiplier=3", "train.steps=3"]
    with pytest.raises(ConfigError, match="init-seed-run"):
        _trainer_plan(pair, tmp_path / "run")


def _json_rows(capsys: pytest.CaptureFixture) -> list[dict]:
    return json.loads(capsys.readouterr().out)


def test_a_fit_at_another_reference_batch_names_that_runs_sigma_and_no_unaccounted_epsilon():
    """--reference-batch-size 512 on runs whose reference is B = 256 printed the B = 256 run's sigma and
    epsilon; at the same eta_step sigma doubles with B, and that run's epsilon is not accounted here."""
    from dpscale.tune.scaling import _reference_noise

    info = {
        "reference_batch_size": 256,
        "reference_noise_multiplier": 0.7314,
        "reference_epsilon": 2.999,
    }
    assert _reference_noise(info, 256) == (0.7314, 2.999)
    assert _reference_noise(info, 512) == (pytest.approx(1.4628), None)

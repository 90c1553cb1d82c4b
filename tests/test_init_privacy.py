"""``model.init=RUN_DIR`` enters the guarantee like a ``checkpoint:`` extractor (issue 24): a run
on this run's training data is composed (private) or refused (non-private) unless declared
public; a run on other data is said, not composed; a source that changed stops a resume."""

import json
import shutil

import pytest

from dpscale.cli import main
from dpscale.config import load_config
from dpscale.errors import ConfigError
from dpscale.privacy import compute_epsilon
from dpscale.privacy.accounting.segments import AccountingSegment
from dpscale.privacy.plan.caveat_texts import SEEDED_CAVEAT
from dpscale._io import load_checkpoint, save_checkpoint
from dpscale.train.loop import Trainer

SMALL = ["model.kwargs={filters: [4, 4]}", "dp.batch_size=64", "train.max_physical_batch_size=64"]
N, B, STEPS, DELTA = 4000, 64, 3, 1e-5  # the embedded MNIST sample; this run's numbers


def _sets(*overrides):
    return [x for item in overrides for x in ("--set", item)]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """``dpscale pretrain`` on this run's training data (the embedded MNIST sample): non-private."""
    out = tmp_path_factory.mktemp("init") / "baseline"
    assert main(["pretrain", "--quiet", *_sets(*SMALL, "train.steps=2", f"run.out_dir={out}")]) == 0
    return out


@pytest.fixture(scope="module")
def private_source(tmp_path_factory):
    """A private, seeded run on the same data: its history and its seed caveat are this run's too."""
    out = tmp_path_factory.mktemp("init") / "private"
    config = load_config(
        None,
        [
            *SMALL,
            "train.steps=2",
            "dp.epsilon=null",
            "dp.noise_multiplier=1.0",
            "run.seed=0",
            f"run.out_dir={out}",
        ],
    )
    Trainer.create(config, progress=False).run()
    return out


def _target(out, source, *extra):
    """A private run at dp.epsilon=3 (sigma calibrated) starting from ``source``'s weights."""
    return load_config(
        None,
        [
            *SMALL,
            f"train.steps={STEPS}",
            "dp.epsilon=3",
            f"model.init={source}",
            f"run.out_dir={out}",
            *extra,
        ],
    )


def _history(run_dir):
    history = load_checkpoint(run_dir / "checkpoint.pt")["mechanism"]["accountant"]["history"]
    return [
        AccountingSegment(float(q), float(sigma), int(steps), label)
        for q, sigma, steps, label in history
    ]


def test_a_non_private_source_on_the_same_data_is_refused(baseline, tmp_path, capsys):
    argv = [
        "train",
        "--quiet",
        *_sets(
            *SMALL,
            f"train.steps={STEPS}",
            "dp.epsilon=3",
            f"model.init={baseline}",
            f"run.out_dir={tmp_path / 'refused'}",
        ),
    ]
    assert main(argv) == 2  # before: trained, "epsilon=3.000", no caveat
    [line] = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert "trained on this run's training data (same data fingerprint) without noise" in line
    assert (
        "model.init_public=true" in line and not (tmp_path / "refused" / "checkpoint.pt").exists()
    )
    # a non-private run may start from one: it claims no guarantee
    assert (
        main(
            [
                "pretrain",
                "--quiet",
                *_sets(
                    *SMALL,
                    "train.steps=1",
                    f"model.init={baseline}",
                    f"run.out_dir={tmp_path / 'again'}",
                ),
            ]
        )
        == 0
    )


def test_a_declared_public_source_is_left_out_and_every_output_says_so(baseline, tmp_path):
    summary = Trainer.create(
        _target(tmp_path / "public", baseline, "model.init_public=true"), progress=False
    ).run()
    alone = compute_epsilon(
        sample_rate=B / N, noise_multiplier=summary["noise_multiplier"], steps=STEPS, delta=DELTA
    )
    assert summary["epsilon"] == pytest.approx(alone, rel=1e-9) and summary["epsilon_parts"] is None
    [note] = summary["guarantee_caveats"]
    assert note.startswith(
        f"model.init_public: the init run {baseline} trained on this run's training data"
    )
    assert "declared public: its cost is not included in epsilon" in note
    records = [
        json.loads(line)
        for line in (tmp_path / "public" / "metrics.jsonl").read_text().splitlines()
    ]
    assert records and all(r["privacy_note"] == note for r in records)
    with pytest.raises(ConfigError, match="model.init_public declares"):
        load_config(None, ["model.init_public=true"])


def test_a_private_source_on_the_same_data_is_composed_into_epsilon(private_source, tmp_path):
    trainer = Trainer.create(_target(tmp_path / "composed", private_source), progress=False)
    summary = trainer.run()
    history = _history(private_source)
    assert [s.label for s in history] == ["dp-sgd"] and history[0].steps == 2
    # the whole history of the source, then this run's steps, composed by the accountant from scratch
    sigma = summary["noise_multiplier"]
    expected = compute_epsilon(
        sample_rate=B / N,
        noise_multiplier=sigma,
        steps=STEPS,
        delta=DELTA,
        kind="pld",
        releases=tuple(history),
    )
    assert summary["epsilon"] == pytest.approx(expected, rel=1e-9)
    # before: this run alone
    assert summary["epsilon"] > compute_epsilon(
        sample_rate=B / N, noise_multiplier=sigma, steps=STEPS, delta=DELTA
    )
    assert 3 * (1 - 1e-3) <= summary["epsilon"] <= 3.0  # sigma calibrated for the composition
    assert set(summary["epsilon_parts"]) == {"init-run:dp-sgd", "dp-sgd"}
    assert summary["privacy_status"].endswith("(composed with the init run)")
    # the source's fixed seed is a caveat of this run's guarantee too
    assert summary["guarantee_caveats"] == [
        f"the init run {private_source} (its cost is composed): {SEEDED_CAVEAT}"
    ]
    assert (
        trainer.plan.init_run.case == "composed"
        and "init-run:* releases" in trainer.plan.describe()
    )


def test_a_source_on_other_data_is_said_not_composed(tmp_path):
    source = tmp_path / "digits-0-4"  # non-private, on other data: the classic public pretraining
    assert (
        main(
            [
                "pretrain",
                "--quiet",
                *_sets(
                    *SMALL, "train.steps=1", "data.classes=[0, 1, 2, 3, 4]", f"run.out_dir={source}"
                ),
            ]
        )
        == 0
    )
    trainer = Trainer.create(
        _target(tmp_path / "other", source, "model.reset_head=true"), progress=False
    )
    summary = trainer.run()
    # before: none (a privacy warning assumed the source public)
    [note] = summary["guarantee_caveats"]
    assert note.startswith(
        f"the init run {source} trained on other data (its data fingerprint differs)"
    )
    assert "overlapping subset is not detected" in note
    assert summary["epsilon"] == pytest.approx(
        compute_epsilon(
            sample_rate=B / N,
            noise_multiplier=summary["noise_multiplier"],
            steps=STEPS,
            delta=DELTA,
        )
    )
    assert trainer.plan.init_run.case == "other data" and trainer.plan.releases == ()


def test_resume_works_and_refuses_a_source_that_changed_since(private_source, tmp_path):
    source = tmp_path / "source"
    shutil.copytree(private_source, source)
    out = tmp_path / "target"
    first = Trainer.create(_target(out, source), progress=False)
    first.run(max_steps=1)
    resumed = Trainer.resume(out, progress=False)  # unchanged source: resumes, same composed plan
    assert resumed.step == 1 and resumed.plan == first.plan
    resumed.close()  # its run directory's lock (held until run, or close)
    state = load_checkpoint(source / "checkpoint.pt")
    state["mechanism"]["accountant"]["history"][-1][2] += 3  # the source trained on since
    state.pop("format")
    save_checkpoint(source / "checkpoint.pt", state)
    with pytest.raises(
        ConfigError, match="the run behind model.init changed since this run started"
    ):
        # before: resumed, its epsilon no longer covering the source
        Trainer.resume(out, progress=False)


def test_a_source_that_is_no_run_directory_is_assumed_public_in_every_output(baseline, tmp_path):
    import torch

    weights = tmp_path / "weights.pt"  # a plain state dict: no data fingerprint, no history to read
    torch.save(load_checkpoint(baseline / "checkpoint.pt")["model"], weights)
    trainer = Trainer.create(_target(tmp_path / "file", weights), progress=False)
    [note] = trainer.plan.caveats()  # before: a privacy warning only, not with every epsilon
    assert note.startswith(
        f"model.init: the guarantee assumes the training data of the initial weights ({weights})"
    )
    assert trainer.plan.init_run.case == "assumed public" and trainer.plan.releases == ()
    with pytest.raises(ConfigError, match="no such run directory or weights file"):
        Trainer.create(_target(tmp_path / "none", tmp_path / "RUN_DIR"), progress=False)

"""Privacy that a run does not spend alone: a checkpoint extractor's run on the same data (its
whole history composed, declared public, or on other data) and a fixed run.seed (a caveat)."""

import json
import shutil

import pytest

from dpscale.cli import main
from dpscale.config import load_config
from dpscale.errors import ConfigError
from dpscale.privacy import compute_epsilon
from dpscale.privacy.accounting.accountant import PrivacyAccountant
from dpscale.privacy.accounting.segments import AccountingSegment
from dpscale.privacy.accounting.calibrate import calibrate_noise_multiplier
from dpscale.privacy.plan.caveat_texts import SEEDED_CAVEAT
from dpscale._io import load_checkpoint, save_checkpoint
from dpscale.train.loop import Trainer

N, PROBE_B, PROBE_STEPS, DELTA = 4000, 500, 4, 1e-5


def _source_config(out_dir, *extra):
    """A 2-step private run on the embedded MNIST sample with private Data Normalization of its
    pixels, so that its history holds DP-SGD steps and a release of its own."""
    return load_config(
        None,
        [
            f"run.out_dir={out_dir}",
            "run.seed=0",
            "dp.epsilon=null",
            "dp.noise_multiplier=1.0",
            "dp.batch_size=32",
            "train.steps=2",
            "features.normalize=datanorm",
            "features.norm_noise=8",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def source_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("extractor") / "source"
    Trainer.create(_source_config(run_dir), progress=False).run()
    return run_dir


def probe_config(out_dir, source, *extra):
    """A linear probe, at a target epsilon of 3, on the penultimate features of ``source``."""
    return load_config(
        None,
        [
            f"run.out_dir={out_dir}",
            "dp.epsilon=3",
            f"dp.batch_size={PROBE_B}",
            f"train.steps={PROBE_STEPS}",
            f"features.extractor=checkpoint:{source}",
            "features.normalize=groupnorm",
            "features.groups=8",
            "model.name=linear",
            *extra,
        ],
    )


def _source_history(source) -> list[AccountingSegment]:
    history = load_checkpoint(source / "checkpoint.pt")["mechanism"]["accountant"]["history"]
    return [
        AccountingSegment(float(q), float(sigma), int(steps), label)
        for q, sigma, steps, label in history
    ]


def test_a_source_on_the_same_data_is_composed_into_every_epsilon(source_run, tmp_path, capsys):
    trainer = Trainer.create(probe_config(tmp_path / "probe", source_run), progress=False)
    assert trainer.plan.extractor.case == "composed" and "composed" in trainer.plan.describe()
    summary = trainer.run()
    # An independent accountant: the source's whole history, then this run's steps.
    history = _source_history(source_run)
    assert {s.label for s in history} == {"dp-sgd", "data-norm"} and any(
        s.sample_rate < 1 and s.steps > 1 for s in history
    )
    independent = PrivacyAccountant("pld")
    for segment in history:
        independent.record(
            AccountingSegment(
                segment.sample_rate,
                segment.noise_multiplier,
                segment.steps,
                f"source {segment.label}",
            )
        )
    q, sigma = PROBE_B / N, summary["noise_multiplier"]
    independent.step(sample_rate=q, noise_multiplier=sigma, num_steps=PROBE_STEPS)
    assert summary["epsilon"] == pytest.approx(independent.epsilon(DELTA), rel=1e-9)
    # sigma was calibrated for the composition: the total meets the target, this run alone is cheaper
    assert 3 * (1 - 1e-3) <= summary["epsilon"] <= 3.0
    assert (
        compute_epsilon(sample_rate=q, noise_multiplier=sigma, steps=PROBE_STEPS, delta=DELTA)
        < summary["epsilon"]
    )
    assert sigma > calibrate_noise_multiplier(
        target_epsilon=3.0, delta=DELTA, sample_rate=q, steps=PROBE_STEPS
    )
    # the source's steps are not this run's
    assert trainer.mechanism.accountant.steps == PROBE_STEPS == summary["steps"]
    # the source ran with a fixed run.seed: its replayable noise is composed, and so is that caveat
    assert summary["extractor_privacy"] == "composed"
    assert summary["guarantee_caveats"] == [
        f"the extractor run checkpoint:{source_run} (its cost is composed): {SEEDED_CAVEAT}"
    ]
    assert set(summary["epsilon_parts"]) == {
        "extractor-run:dp-sgd",
        "extractor-run:data-norm",
        "dp-sgd",
    }
    # Resume and eval recompute the releases from the source and keep the composed epsilon.
    assert main(["eval", str(tmp_path / "probe"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (
        result["epsilon"] == pytest.approx(summary["epsilon"])
        and result["extractor_privacy"] == "composed"
    )
    assert main(["eval", str(tmp_path / "probe")]) == 0
    assert "epsilon includes the extractor's run" in capsys.readouterr().out


def test_a_declared_public_source_reports_the_single_run_epsilon_and_says_so(source_run, tmp_path):
    config = probe_config(tmp_path / "public", source_run, "features.extractor_public=true")
    summary = Trainer.create(config, progress=False).run()
    alone = compute_epsilon(
        sample_rate=PROBE_B / N,
        noise_multiplier=summary["noise_multiplier"],
        steps=PROBE_STEPS,
        delta=DELTA,
    )
    assert summary["epsilon"] == pytest.approx(alone, rel=1e-9) and summary["epsilon"] <= 3.0
    assert summary["extractor_privacy"] == "declared public" and summary["epsilon_parts"] is None
    [note] = summary["guarantee_caveats"]
    assert "declared public" in note and "its cost is not included" in note
    records = [
        json.loads(line)
        for line in (tmp_path / "public" / "metrics.jsonl").read_text().splitlines()
    ]
    assert all(r["privacy_note"] == note for r in records)


def _copy_with(source, tmp_path, name, **changes):
    """A copy of the source run whose checkpoint has ``changes`` applied (as if it had changed)."""
    copy = tmp_path / name
    shutil.copytree(source, copy)
    state = load_checkpoint(copy / "checkpoint.pt")
    state.update(changes)
    state.pop("format")
    save_checkpoint(copy / "checkpoint.pt", state)
    return copy


def test_a_source_on_other_data_is_not_composed_but_said(source_run, tmp_path):
    other = _copy_with(source_run, tmp_path, "other", data_fingerprint="0" * 64)
    trainer = Trainer.create(probe_config(tmp_path / "probe", other), progress=False)
    assert trainer.plan.extractor.case == "other data" and not trainer.plan.releases
    [note] = trainer.plan.caveats()
    assert "other data" in note and "overlapping subset is not detected" in note
    assert "trained on other data" in trainer.plan.describe()


def test_the_fingerprint_is_compared_under_the_source_s_data_normalize(source_run, tmp_path):
    # The same images prepared the other way ([0, 1] pixels): still this run's training data.
    trainer = Trainer.create(
        probe_config(tmp_path / "raw", source_run, "data.normalize=false"), progress=False
    )
    assert trainer.plan.extractor.case == "composed" and len(trainer.plan.releases) == 2


def test_a_non_private_source_on_the_same_data_is_refused_unless_declared_public(tmp_path):
    source = tmp_path / "baseline"
    Trainer.create(
        load_config(
            None,
            [
                f"run.out_dir={source}",
                "dp.epsilon=null",
                "dp.noise_multiplier=0",
                "dp.max_grad_norm=null",
                "dp.batch_size=32",
                "train.steps=2",
            ],
        ),
        progress=False,
    ).run()
    with pytest.raises(ConfigError, match="without noise.*features.extractor_public"):
        Trainer.create(probe_config(tmp_path / "refused", source), progress=False)
    public = Trainer.create(
        probe_config(tmp_path / "public", source, "features.extractor_public=true"), progress=False
    )
    assert public.plan.extractor.case == "declared public" and not public.plan.releases
    with pytest.raises(ConfigError, match="extractor_public.*checkpoint"):
        load_config(None, ["features.extractor=scatternet", "features.extractor_public=true"])


def test_resume_refuses_a_source_that_changed_since(source_run, tmp_path):
    source = tmp_path / "source"
    shutil.copytree(source_run, source)
    Trainer.create(probe_config(tmp_path / "probe", source), progress=False).run(max_steps=2)
    resumed = Trainer.resume(tmp_path / "probe", progress=False)  # unchanged source: resumes
    assert resumed.step == 2 and resumed.plan.extractor.case == "composed"
    resumed.close()  # its run directory's lock (held until run, or close)
    state = load_checkpoint(source / "checkpoint.pt")
    state["mechanism"]["accountant"]["history"][-1][2] += 3  # the source trained on
    state.pop("format")
    save_checkpoint(source / "checkpoint.pt", state)
    with pytest.raises(ConfigError, match="changed since this run started"):
        Trainer.resume(tmp_path / "probe", progress=False)


# --------------------------------------------------------------------- run.seed
def _tiny(out_dir, *extra):
    return load_config(
        None,
        [
            f"run.out_dir={out_dir}",
            "model.name=linear",
            "dp.batch_size=256",
            "dp.accountant=rdp",
            "train.steps=3",
            "train.eval_every_epochs=100",
            *extra,
        ],
    )


def test_a_seeded_run_says_so_with_every_epsilon(tmp_path, capsys):
    summary = Trainer.create(_tiny(tmp_path / "seeded", "run.seed=0"), progress=True).run()
    err = capsys.readouterr().err
    assert SEEDED_CAVEAT in summary["guarantee_caveats"] and summary["seeded"] is True
    assert err.count(f"WARNING: {SEEDED_CAVEAT}") == 1  # once: the start-up header
    [record] = [
        json.loads(line)
        for line in (tmp_path / "seeded" / "metrics.jsonl").read_text().splitlines()
    ]
    assert SEEDED_CAVEAT in record["privacy_note"]
    assert main(["eval", str(tmp_path / "seeded")]) == 0
    assert f"WARNING: {SEEDED_CAVEAT}" in capsys.readouterr().out

    summary = Trainer.create(_tiny(tmp_path / "unseeded"), progress=True).run()
    assert SEEDED_CAVEAT not in capsys.readouterr().err
    assert summary["guarantee_caveats"] == [] and summary["seeded"] is False
    [record] = [
        json.loads(line)
        for line in (tmp_path / "unseeded" / "metrics.jsonl").read_text().splitlines()
    ]
    assert "privacy_note" not in record


def test_an_older_checkpoint_without_the_seeded_label_resumes(tmp_path):
    Trainer.create(
        _tiny(tmp_path / "r", "run.seed=0", "train.checkpoint_every_steps=1"), progress=False
    ).run(max_steps=1)
    state = load_checkpoint(tmp_path / "r" / "checkpoint.pt")
    for label in ("seeded", "extractor"):  # written before these labels existed
        del state["mechanism"]["plan"][label]
    state.pop("format")
    save_checkpoint(tmp_path / "r" / "checkpoint.pt", state)
    summary = Trainer.resume(tmp_path / "r", progress=False).run()
    assert summary["steps"] == 3 and SEEDED_CAVEAT in summary["guarantee_caveats"]


def test_sweeps_and_clip_lr_over_seeds_carry_the_caveat(tmp_path, capsys):
    sets = [
        x
        for item in (
            "model.name=linear",
            "dp.batch_size=512",
            "dp.accountant=rdp",
            "train.steps=2",
            "train.eval_every_epochs=100",
        )
        for x in ("--set", item)
    ]
    assert (
        main(["sweep", "--quiet", "--out", str(tmp_path / "s"), *sets, "--grid", "run.seed=0,1"])
        == 0
    )
    assert f"WARNING: {SEEDED_CAVEAT}" in (tmp_path / "s" / "sweep.md").read_text()
    capsys.readouterr()
    assert (
        main(
            [
                "tune",
                "clip-lr",
                "--quiet",
                "--out",
                str(tmp_path / "t"),
                *sets,
                "--clip-norms",
                "1",
                "--lr-factors",
                "1",
                "--tolerance",
                "1",
                "--seeds",
                "0,1",
            ]
        )
        == 0
    )
    assert f"WARNING: {SEEDED_CAVEAT}" in capsys.readouterr().out
    assert f"WARNING: {SEEDED_CAVEAT}" in (tmp_path / "t" / "lr" / "sweep.md").read_text()

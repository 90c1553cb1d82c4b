"""Sweeps, TAN simulations through the trainer, `tan fit`, `tune clip-lr` (the TAN privacy commands: test_tune_privacy_cli.py)."""

import json
import shutil
from pathlib import Path

import pytest

from dpscale.cli import main
from dpscale.config import load_config
from dpscale.errors import ConfigError
from dpscale._io import load_checkpoint
from dpscale.train.loop import Trainer
from dpscale.tune import TUNING_CAVEAT
from dpscale.privacy.plan.caveat_texts import SEEDED_CAVEAT
from dpscale.tune.clip_lr import GridValue, choose_clip_norm
from dpscale.tune.sweep import Sweep, SweepSpec, parse_grid, split_values
from helpers import TINY_RUN_SETS, set_flags


# ------------------------------------------------------------------- grid
def test_split_values_respects_brackets_and_quotes():
    assert split_values("1,2, 3") == ["1", "2", "3"]
    assert split_values("[16, 16],[32,32]") == ["[16, 16]", "[32,32]"]
    assert split_values("'a,b',c") == ["'a,b'", "c"]
    assert parse_grid("optim.lr=0.5,1") == ("optim.lr", ("0.5", "1"))
    for bad in ("optim.lr", "optim.lr=", "=1,2", "optim.lr=1,,2", "optim.lr=[1,2", "optim.lr=1,1"):
        with pytest.raises(ConfigError):
            parse_grid(bad)


def test_sweep_rejects_a_bad_point_before_training_anything(tmp_path):
    spec = SweepSpec(None, tuple(TINY_RUN_SETS), (("optim.lr", ("1", "-1")),))
    with pytest.raises(ConfigError, match=r"001-optim.lr=-1.*optim.lr must be > 0"):
        Sweep(tmp_path / "s", spec, progress=False).prepare()
    assert not (tmp_path / "s").exists()
    with pytest.raises(ConfigError, match="unknown config key"):
        Sweep(
            tmp_path / "s",
            SweepSpec(None, tuple(TINY_RUN_SETS), (("optim.lrr", ("1",)),)),
            progress=False,
        ).prepare()


# ------------------------------------------------------ TAN simulated run
def test_simulated_run_reports_the_reference_epsilon_and_no_guarantee(tmp_path, capsys):
    out = tmp_path / "sim"
    code = main(
        [
            "tan",
            "simulate",
            "--batch-size",
            "128",
            "--quiet",
            *set_flags(*TINY_RUN_SETS, "run.seed=0", f"run.out_dir={out}"),
        ]
    )
    assert code == 0
    stdout, stderr = capsys.readouterr()
    assert "TAN SIMULATION (no guarantee): stands for epsilon=" in stdout  # the result line
    assert "NO PRIVACY GUARANTEE" in stderr  # the caveat, once, when the run starts
    summary = json.loads((out / "summary.json").read_text())
    sim = summary["simulation"]
    assert summary["batch_size"] == 128 and sim["batch_size"] == 512 and summary["steps"] == 12
    assert summary["sample_rate"] / summary["noise_multiplier"] == pytest.approx(
        sim["sample_rate"] / sim["noise_multiplier"], rel=1e-13
    )
    assert summary["reference_epsilon"] == pytest.approx(sim["epsilon"], rel=1e-9)
    assert summary["reference_epsilon"] <= 3.0 < summary["epsilon"]  # stands for 3, spends more
    assert summary["private"] is False  # not a private model, whatever sigma it ran at
    assert any(n.startswith("TAN SIMULATION") for n in summary["guarantee_caveats"])
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("reference_epsilon" in r and "TAN SIMULATION" in r["privacy_note"] for r in records)
    # the accountant saw the steps that ran: q = 128 / N at the simulated sigma, RDP
    state = load_checkpoint(out / "checkpoint.pt")
    assert (
        state["mechanism"]["accountant"]["kind"] == "rdp"
        and len(state["mechanism"]["accountant"]["history"]) == 1
    )
    q, sigma, steps, _ = state["mechanism"]["accountant"]["history"][0]
    assert (q, steps) == (summary["sample_rate"], 12) and sigma == summary["noise_multiplier"]
    code = main(["eval", str(out), "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["reference_epsilon"] == pytest.approx(summary["reference_epsilon"])


def test_simulated_run_resumes_bit_identically(tmp_path):
    sets = [
        *TINY_RUN_SETS,
        "run.seed=3",
        "dp.simulated_batch_size=200",
        "train.checkpoint_every_steps=1",
    ]
    whole = Trainer.create(
        load_config(None, [*sets, f"run.out_dir={tmp_path / 'a'}"]), progress=False
    )
    whole.run()
    part = Trainer.create(
        load_config(None, [*sets, f"run.out_dir={tmp_path / 'b'}"]), progress=False
    )
    assert part.run(max_steps=5) is None
    resumed = Trainer.resume(tmp_path / "b", progress=False)
    summary = resumed.run()
    for name, tensor in whole.model.state_dict().items():
        assert tensor.equal(resumed.model.state_dict()[name])
    expected = json.loads((tmp_path / "a" / "summary.json").read_text())
    expected.pop("wall_time_s"), summary.pop("wall_time_s")
    assert summary == expected


def test_simulate_dry_run_prints_both_plans(capsys):
    assert (
        main(["tan", "simulate", "--batch-size", "64", "--dry-run", *set_flags(*TINY_RUN_SETS)])
        == 0
    )
    out = capsys.readouterr().out
    assert "reference run:  B=512" in out and "simulated run:  B=64" in out and "0.125x" in out
    assert (
        main(["tan", "simulate", "--batch-size", "512", "--dry-run", *set_flags(*TINY_RUN_SETS)])
        == 2
    )
    assert "must be smaller" in capsys.readouterr().err


def test_simulation_evaluates_at_the_reference_runs_steps(tmp_path):
    # B_ref = 512 of N = 4000: an evaluation every 0.25 reference epochs is every ~2 steps, at any B
    sets = [
        *TINY_RUN_SETS,
        "train.eval_every_epochs=0.25",
        f"run.out_dir={tmp_path / 'sim'}",
        "dp.simulated_batch_size=64",
    ]
    Trainer.create(load_config(None, sets), progress=False).run()
    steps = [
        json.loads(x)["step"] for x in (tmp_path / "sim" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [2, 4, 6, 8, 10, 12]


def test_an_interrupted_rerun_keeps_every_finished_point(tmp_path, monkeypatch):
    spec = SweepSpec(None, (*TINY_RUN_SETS, "train.steps=2"), (("optim.lr", ("1", "2", "3", "4")),))
    first = Sweep(tmp_path / "s", spec, progress=False).run()
    assert len(first) == 4
    for lost in (1, 3):  # these points "died" after their last checkpoint
        (Path(first[lost].run_dir) / "summary.json").unlink()
    original, calls = Trainer.resume.__func__, []

    def resume_then_interrupt(cls, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the rerun finishes point 1, then is interrupted at point 3
            raise KeyboardInterrupt
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(Trainer, "resume", classmethod(resume_then_interrupt))
    with pytest.raises(KeyboardInterrupt):
        Sweep(tmp_path / "s", spec, progress=False).run()
    records = [json.loads(x) for x in (tmp_path / "s" / "sweep.jsonl").read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2]  # point 2, finished before, is still there


def test_sweep_and_tan_fit_end_to_end(tmp_path, capsys, monkeypatch):
    sweep_dir = tmp_path / "sweep"
    args = [
        "sweep",
        "--quiet",
        "--out",
        str(sweep_dir),
        *set_flags(*TINY_RUN_SETS),
        "--grid",
        "dp.simulated_batch_size=64,128,256",
        "--grid",
        "run.seed=0,1",
    ]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert TUNING_CAVEAT in table and "reference_epsilon" in table
    records = [json.loads(x) for x in (sweep_dir / "sweep.jsonl").read_text().splitlines()]
    assert len(records) == 6 and all(r["status"] == "done" for r in records)
    accuracies = [r["summary"]["test_accuracy"] for r in records]
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [float(row.split("|")[4]) for row in rows] == pytest.approx(
        sorted(accuracies, reverse=True), abs=1e-4
    )

    # rerunning skips finished points; a point that died mid-way is resumed, a lost one redone
    (Path(records[1]["run_dir"]) / "summary.json").unlink()
    created = []
    original = Trainer.create.__func__
    monkeypatch.setattr(
        Trainer,
        "create",
        classmethod(lambda cls, *a, **k: created.append(1) or original(cls, *a, **k)),
    )
    assert main(args) == 0
    capsys.readouterr()
    assert created == []  # point 1 resumed from its checkpoint, the others skipped
    again = [json.loads(x) for x in (sweep_dir / "sweep.jsonl").read_text().splitlines()]
    assert [r["summary"]["test_accuracy"] for r in again] == accuracies

    # a reference run at B_ref, then the fit
    ref = tmp_path / "ref"
    assert (
        main(["train", "--quiet", *set_flags(*TINY_RUN_SETS, "run.seed=0", f"run.out_dir={ref}")])
        == 0
    )
    capsys.readouterr()
    assert main(["tan", "fit", str(sweep_dir), "--reference", str(ref)]) == 0
    out = capsys.readouterr().out
    assert "prediction at B_ref=512" in out and "error measured - predicted" in out
    fit = json.loads((sweep_dir / "tan_fit.json").read_text())
    assert fit["reference_batch_size"] == 512 and fit["fit"]["points"] == 6
    assert fit["tuning_caveat"] == TUNING_CAVEAT
    assert fit["measured_reference"] == pytest.approx(
        json.loads((ref / "summary.json").read_text())["test_accuracy"]
    )
    assert fit["error"] == pytest.approx(fit["measured_reference"] - fit["prediction"]["value"])
    assert (sweep_dir / "tan_fit.png").stat().st_size > 1000


def test_tan_fit_refuses_mixed_eta_step_or_other_varying_keys(tmp_path, capsys):
    sweep_dir = tmp_path / "sweep"
    assert (
        main(
            [
                "sweep",
                "--quiet",
                "--out",
                str(sweep_dir),
                *set_flags(*TINY_RUN_SETS, "train.steps=4"),
                "--grid",
                "dp.simulated_batch_size=64,128",
                "--grid",
                "dp.max_grad_norm=0.5,1",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["tan", "fit", str(sweep_dir), "--no-plot"]) == 2
    assert "also varies dp.max_grad_norm" in capsys.readouterr().err
    assert main(["tan", "fit", str(sweep_dir), "--no-plot", "--where", "dp.max_grad_norm=1"]) == 0
    # the same sweep twice, or runs of another setting, are refused
    code = main(
        ["tan", "fit", str(sweep_dir), str(sweep_dir), "--no-plot", "--where", "dp.max_grad_norm=1"]
    )
    assert code == 2 and "counted twice" in capsys.readouterr().err
    lr_sweep = tmp_path / "lr"
    assert (
        main(
            [
                "sweep",
                "--quiet",
                "--out",
                str(lr_sweep),
                *set_flags(*TINY_RUN_SETS, "train.steps=4", "optim.lr=1"),
                "--grid",
                "dp.simulated_batch_size=256",
                "--grid",
                "dp.max_grad_norm=1",
            ]
        )
        == 0
    )
    capsys.readouterr()
    code = main(
        ["tan", "fit", str(sweep_dir), str(lr_sweep), "--no-plot", "--where", "dp.max_grad_norm=1"]
    )
    assert (
        code == 2
        and "configs differ in more than the batch size and seed: optim.lr ("
        in capsys.readouterr().err
    )
    # how often a run is scored is not part of the setting: a copy scored every epoch pools
    from dpscale.tune.scaling import _check_one_setting

    run = sorted((sweep_dir / "runs").iterdir())[0]
    scored = tmp_path / "scored"
    shutil.copytree(run, scored)
    config = scored / "config.yaml"
    config.write_text(
        config.read_text().replace("  eval_every_epochs:", "  eval_every_epochs: 1.0 #")
    )
    _check_one_setting([str(run), str(scored)])
    config.write_text(config.read_text().replace("  max_grad_norm:", "  max_grad_norm: 7.0 #"))
    with pytest.raises(
        ValueError, match=r"differ in more than the batch size and seed: dp.max_grad_norm \("
    ):
        _check_one_setting([str(run), str(scored)])
    # a non-simulated run at another B has another eta_step: refused
    other = tmp_path / "other"
    assert (
        main(
            [
                "train",
                "--quiet",
                *set_flags(
                    *TINY_RUN_SETS, "train.steps=4", "dp.batch_size=256", f"run.out_dir={other}"
                ),
            ]
        )
        == 0
    )
    capsys.readouterr()
    code = main(
        [
            "tan",
            "fit",
            str(sweep_dir),
            "--no-plot",
            "--where",
            "dp.max_grad_norm=1",
            "--reference",
            str(other),
        ]
    )
    assert code == 2 and "do not share one" in capsys.readouterr().err


def test_sweep_records_failed_points_and_continues(tmp_path, capsys):
    # dp.batch_size=8000 > N=4000 fails when the trainer sees the data; the other point runs.
    sets = set_flags(*TINY_RUN_SETS, "train.steps=3")
    code = main(
        [
            "sweep",
            "--quiet",
            "--out",
            str(tmp_path / "s"),
            *sets,
            "--grid",
            "dp.batch_size=256,8000",
        ]
    )
    assert code == 1
    records = [json.loads(x) for x in (tmp_path / "s" / "sweep.jsonl").read_text().splitlines()]
    assert [r["status"] for r in records] == ["done", "failed"]
    assert "larger than the training set" in records[1]["error"]
    assert "Failed points" in capsys.readouterr().out


# ------------------------------------------------------------- clip-lr
def test_choose_clip_norm_takes_the_smallest_within_tolerance():
    values = [
        GridValue(None, 0.90, 1),
        GridValue(0.1, 0.80, 1),
        GridValue(0.3, 0.895, 1),
        GridValue(1.0, 0.91, 1),
    ]
    assert choose_clip_norm(values, 0.01) == (0.3, 0.90)
    assert choose_clip_norm(values, 0.2) == (0.1, 0.90)
    with pytest.raises(ValueError, match="no clipping norm"):
        choose_clip_norm(values[:2], 0.01)
    # for a loss, lower is better
    losses = [GridValue(None, 0.30, 1), GridValue(0.1, 0.50, 1), GridValue(0.3, 0.305, 1)]
    assert choose_clip_norm(losses, 0.01, higher_is_better=False) == (0.3, 0.30)


def test_tune_clip_lr_end_to_end(tmp_path, capsys):
    out = tmp_path / "tune"
    code = main(
        [
            "tune",
            "clip-lr",
            "--quiet",
            "--out",
            str(out),
            *set_flags(*TINY_RUN_SETS, "train.steps=6", "run.seed=0"),
            "--clip-norms",
            "0.01,1",
            "--lr-factors",
            "0.5,2",
            "--tolerance",
            "0.05",
        ]
    )
    assert code == 0
    report = capsys.readouterr().out
    assert TUNING_CAVEAT in report and "lr x C" in report
    result = json.loads((out / "clip_lr.json").read_text())
    clip = [json.loads(x) for x in (out / "clip" / "sweep.jsonl").read_text().splitlines()]
    assert [r["point"]["dp.max_grad_norm"] for r in clip] == [None, 0.01, 1.0]
    assert all(not r["summary"]["private"] for r in clip)  # stage 2 is at sigma = 0
    unclipped = clip[0]["summary"]["test_accuracy"]
    ok = [
        r["point"]["dp.max_grad_norm"]
        for r in clip[1:]
        if unclipped - r["summary"]["test_accuracy"] <= 0.05
    ]
    assert result["chosen_clip_norm"] == min(ok)
    lr = [json.loads(x) for x in (out / "lr" / "sweep.jsonl").read_text().splitlines()]
    assert [r["point"]["optim.lr"] for r in lr] == [1.0, 4.0]  # alpha_pub = 2
    assert all(
        r["summary"]["private"] and r["summary"]["max_grad_norm"] == result["chosen_clip_norm"]
        for r in lr
    )
    best = max(lr, key=lambda r: r["summary"]["test_accuracy"])
    assert result["chosen_lr"] == best["point"]["optim.lr"]
    assert result["lr_times_clip"] == pytest.approx(
        result["chosen_lr"] * result["chosen_clip_norm"]
    )
    # run.seed is fixed: the private stage's caveat is in the json, the markdown and on screen
    assert SEEDED_CAVEAT in result["guarantee_caveats"]
    assert (
        SEEDED_CAVEAT in (out / "clip_lr.md").read_text() and f"WARNING: {SEEDED_CAVEAT}" in report
    )

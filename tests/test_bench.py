"""The step-time benchmark runs and reports what it promises (no timing assertions)."""

import json

from dpscale.cli import main


def test_step_time_benchmark_json_rows(capsys, tmp_path):
    out = tmp_path / "bench.md"
    code = main(
        [
            "bench",
            "step-time",
            "--models",
            "papernot-cnn",
            "--engines",
            "nonprivate,dpscale-bk,dpscale-vmap",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--json",
            "--write",
            str(out),
        ]
    )
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["engine"] for r in rows] == ["nonprivate", "dpscale-bk", "dpscale-vmap"]
    for row in rows:
        assert set(row) == {
            "model",
            "batch_size",
            "engine",
            "median_ms",
            "ratio_to_nonprivate",
            "peak_mem_mb",
        }
        assert row["model"] == "papernot-cnn" and row["batch_size"] == 256 and row["median_ms"] > 0
    assert rows[0]["ratio_to_nonprivate"] == 1.0
    table = out.read_text()
    assert (
        "dpscale bench step-time --models papernot-cnn" in table
        and "| papernot-cnn | 256 | dpscale-bk |" in table
    )


def test_step_time_peft_twins_train_fewer_parameters(capsys, monkeypatch):
    """``--peft lora`` adds a -lora twin after each dpscale row, built with the adapters only trainable."""
    from dpscale.bench import step_time

    built = []
    real = step_time.apply_peft
    monkeypatch.setattr(
        step_time,
        "apply_peft",
        lambda model, method, **kw: built.append((method, real(model, method, **kw))),
    )
    assert (
        main(
            [
                "bench",
                "step-time",
                "--models",
                "papernot-cnn",
                "--engines",
                "nonprivate,dpscale-bk",
                "--peft",
                "lora",
                "--lora-rank",
                "2",
                "--batch-size",
                "8",
                "--repeats",
                "1",
                "--warmup",
                "0",
                "--json",
            ]
        )
        == 0
    )
    assert [r["engine"] for r in json.loads(capsys.readouterr().out)] == [
        "nonprivate",
        "dpscale-bk",
        "dpscale-bk-lora",
    ]
    assert built[0] == ("none", 26_010) and built[1][0] == "lora" and built[1][1] < 26_010 / 5


def test_unknown_engine_is_skipped_with_a_note(capsys):
    assert (
        main(
            [
                "bench",
                "step-time",
                "--models",
                "linear",
                "--engines",
                "nonprivate,dpscale-warp",
                "--repeats",
                "1",
                "--warmup",
                "0",
                "--json",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert [r["engine"] for r in json.loads(captured.out)] == ["nonprivate"]
    assert "dpscale-warp" in captured.err


def test_step_time_in_bf16_at_a_given_batch_size(capsys, tmp_path):
    out = tmp_path / "bench.md"
    code = main(
        [
            "bench",
            "step-time",
            "--models",
            "papernot-cnn",
            "--engines",
            "nonprivate,dpscale-auto,dpscale-vmap",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--precision",
            "bf16",
            "--batch-size",
            "16",
            "--write",
            str(out),
        ]
    )
    assert code == 0
    table = out.read_text()
    assert "precision: bf16" in table and "| papernot-cnn | 16 | dpscale-auto |" in table
    assert "| papernot-cnn | 16 | dpscale-vmap |" in table


def test_peak_memory_is_measured_after_releasing_what_the_previous_step_left():
    """A step that leaves 4 MB behind (like Opacus' grad_sample): the leftover is released
    before the measured step (on CUDA it would otherwise sit in the baseline, and its free
    inside the step would hide the step's own allocation), and the step's own 4 MB count."""
    import torch

    from dpscale.bench.step_time import TimedStep, _peak_memory_mb

    kept, released = [], []

    def step():
        kept.clear()
        kept.append(torch.ones(2**20))

    def release():
        released.append(len(kept))
        kept.clear()

    step()
    peak = _peak_memory_mb(TimedStep(step, release), torch.device("cpu"))
    assert released == [1] and 3.9 < peak < 4.2


def test_end_to_end_benchmark_trains_both_recipes(capsys, tmp_path):
    """dpscale's row is a real run; Opacus' (when installed) trains the same model, data and
    plan: same steps, same epsilon target, an accuracy in the same range."""
    import importlib.util

    code = main(
        [
            "bench",
            "end-to-end",
            "--set",
            "train.steps=6",
            "--set",
            "run.seed=0",  # the embedded MNIST sample
            "--set",
            "dp.batch_size=256",
            "--out",
            str(tmp_path / "runs"),
            "--json",
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    rows = {r["library"]: r for r in json.loads(captured.out)}
    assert (
        rows["dpscale"]["steps"] == 6
        and rows["dpscale"]["whole_s"] >= rows["dpscale"]["training_s"] > 0
    )
    assert (tmp_path / "runs" / "dpscale" / "summary.json").exists()
    if importlib.util.find_spec("opacus") is None:
        assert "skip opacus: not installed" in captured.err
        return
    opacus = rows["opacus"]
    assert opacus["steps"] == 6 and opacus["whole_s"] >= opacus["training_s"] > 0
    assert abs(opacus["test_accuracy"] - rows["dpscale"]["test_accuracy"]) < 0.25


def test_every_opacus_mode_runs_when_opacus_is_installed(capsys):
    import pytest

    pytest.importorskip("opacus")
    modes = ["opacus-hooks", "opacus-functorch", "opacus-ew", "opacus-ghost"]
    assert (
        main(
            [
                "bench",
                "step-time",
                "--models",
                "linear",
                "--engines",
                ",".join(["nonprivate", *modes]),
                "--repeats",
                "1",
                "--warmup",
                "0",
                "--json",
            ]
        )
        == 0
    )
    assert [r["engine"] for r in json.loads(capsys.readouterr().out)] == ["nonprivate", *modes]


def test_step_time_user_twins_clip_per_user(capsys, monkeypatch):
    """``--user-rows 4`` adds a -user4 twin after each dpscale row: the same images as B/4 users of 4,
    through make_private's user unit (its plan counts B/4 users per step)."""
    from dpscale.train import private

    plans = []
    real = private.make_private
    monkeypatch.setattr(
        private,
        "make_private",
        lambda *a, **kw: plans.append(real(*a, **kw).plan) or real(*a, **kw),
    )
    assert (
        main(
            [
                "bench",
                "step-time",
                "--models",
                "papernot-cnn",
                "--engines",
                "nonprivate,dpscale-bk",
                "--user-rows",
                "4",
                "--batch-size",
                "8",
                "--repeats",
                "1",
                "--warmup",
                "0",
                "--json",
            ]
        )
        == 0
    )
    assert [r["engine"] for r in json.loads(capsys.readouterr().out)] == [
        "nonprivate",
        "dpscale-bk",
        "dpscale-bk-user4",
    ]
    assert [(p.privacy_unit, p.batch_size) for p in plans] == [("example", 8), ("user", 2)]


def test_step_time_on_the_thread_clock_states_clock_and_load(capsys, tmp_path):
    """--clock thread: one torch thread, thread-CPU time, and the table says so with the load."""
    import torch

    out = tmp_path / "bench.md"
    threads = torch.get_num_threads()
    try:
        assert (
            main(
                [
                    "bench",
                    "step-time",
                    "--models",
                    "papernot-cnn",
                    "--engines",
                    "nonprivate,dpscale-bk,dpscale-auto",
                    "--batch-size",
                    "8",
                    "--repeats",
                    "2",
                    "--warmup",
                    "0",
                    "--clock",
                    "thread",
                    "--write",
                    str(out),
                ]
            )
            == 0
        )
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    table = out.read_text()
    assert (
        "clock: thread-CPU time of the timing thread; load average" in table
        and "1 torch threads" in table
    )
    assert (
        main(["bench", "step-time", "--models", "linear", "--clock", "thread", "--threads", "2"])
        == 2
    )
    assert "--clock thread times one torch thread" in capsys.readouterr().err


def test_bk_and_auto_rows_that_ran_one_engine_but_disagree_flag_the_table_noisy():
    from dpscale.bench.step_time import Row, markdown_table, noisy_rows

    rows = [
        Row("m", 8, "nonprivate", 10.0, 1.0, 1.0, 3),
        Row("m", 8, "dpscale-bk", 15.0, 1.5, 1.0, 3, "BKEngine"),
        Row("m", 8, "dpscale-auto", 17.0, 1.7, 1.0, 3, "BKEngine"),
        Row("m", 8, "dpscale-bk-user4", 15.0, 1.5, 1.0, 3, "BKEngine"),
        Row("m", 8, "dpscale-auto-user4", 15.3, 1.53, 1.0, 3, "BKEngine"),
    ]
    assert noisy_rows(rows) == [
        "m B=8: dpscale-bk and dpscale-auto both ran BKEngine but differ by 13% (> 5%)"
    ]
    assert "**NOISY**" in markdown_table(rows, "cmd", "cpu")
    # other engines
    assert (
        noisy_rows([*rows[:2], Row("m", 8, "dpscale-auto", 17.0, 1.7, 1.0, 3, "VmapEngine")]) == []
    )

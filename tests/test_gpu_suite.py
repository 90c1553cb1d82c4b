"""The device acceptance suite's CPU form (issue 44): every section runs and passes at tiny sizes,
the report is one markdown file, and a failing check turns the exit code to 1."""

from __future__ import annotations

import pytest

from dpscale.cli import main


def test_the_cpu_form_of_the_device_suite_passes_and_writes_its_report(tmp_path):
    out = tmp_path / "report.md"
    assert (
        main(
            ["bench", "gpu-suite", "--device", "cpu", "--quick", "--batch", "4", "--out", str(out)]
        )
        == 0
    )
    report = out.read_text()
    for section in (
        "## 1. Engines",
        "## 2. The clip bound in 16-bit",
        "## 3. make_private on the device",
        "## 4. Step time",
        "## 5. The training loop",
        "## 6. Operators per step",
        "## 7. Chunk size auto vs fixed",
        "## 8. Eager vs compiled step",
    ):
        assert section in report
    checks = [
        line
        for line in report.splitlines()
        if line.startswith("| ") and line.rstrip().endswith(("ok |", "FAIL |"))
    ]
    assert len(checks) >= 4 + 8 + 3 + 2 + 3 and all(line.endswith("ok |") for line in checks)
    assert "| mnist-5k (embedded), 6 steps, chunks of 16 | 6 |" in report
    assert "| mnist-5k (embedded), 6 steps, chunks of 64 | 6 |" in report
    # section 7: the preset's 16, auto (the largest logical batch, 64 + 4 sqrt(64)), auto under a budget that binds
    chunks = {
        cells[1]: int(cells[2])
        for cells in (line.split(" | ") for line in checks)
        if cells[0] == "| mnist-5k (embedded), 6 steps" and len(cells) == 8
    }
    bound = next(setting for setting in chunks if "memory_budget_mb" in setting)
    assert chunks["16 (the preset's)"] == 16 and chunks["auto"] == 96 and 1 <= chunks[bound] < 96
    # section 8 at B = 4 and 8, nothing compiled on a CPU with --quick (said where it would be)
    assert (
        "| papernot-cnn | 4 | dpscale-auto | GhostEngine |" in report
        and "| papernot-cnn | 8 | dpscale-auto |" in report
    )
    assert (
        report.count("compiled rows left out: --quick on a CPU") == 2 and "-compiled" not in report
    )
    # where the methods came from
    assert "- tuner: papernot-cnn B=4 dpscale-auto clip methods" in report


def test_a_failing_check_fails_the_suite(tmp_path, monkeypatch):
    from dpscale.bench import gpu_suite

    # a bound broken on the device
    monkeypatch.setattr(gpu_suite, "worst_single_example_norm", lambda *args: 1.5)
    # (the first test runs them)
    monkeypatch.setattr(gpu_suite.gpu_sections, "chunk_rows", lambda *args: [])
    monkeypatch.setattr(gpu_suite.gpu_sections, "compiled_step_rows", lambda *args: [])
    out = tmp_path / "report.md"
    assert (
        main(
            ["bench", "gpu-suite", "--device", "cpu", "--quick", "--batch", "2", "--out", str(out)]
        )
        == 1
    )
    assert "| 1.500000000 | " in out.read_text() and "FAIL" in out.read_text()


def test_each_section_is_written_when_it_ends_and_an_error_in_one_is_a_fail_row(monkeypatch):
    """A device run stopped by its time limit keeps the sections it finished; an exception in the
    step-time table (which brings its own header) becomes a FAIL row, not a crash."""
    from dpscale.bench import gpu_suite

    monkeypatch.setattr(gpu_suite, "engine_rows", lambda *args: ["| m | bk | 0 | 0 | 1 | 1 | ok |"])
    monkeypatch.setattr(gpu_suite, "sixteen_bit_rows", lambda *args: ["| m | bf16 | bk | 1 | ok |"])
    monkeypatch.setattr(gpu_suite, "mechanism_rows", lambda *args: ["| dp-sgd | 0 | ok |"])

    def broken(*args):
        raise RuntimeError("CUDA out of memory\nsecond line")

    monkeypatch.setattr(gpu_suite, "_step_time_rows", broken)
    monkeypatch.setattr(
        gpu_suite, "training_rows", lambda *args: ["| d | 1 | 1 | n/a | n/a | 50% | 1 | ok |"]
    )
    monkeypatch.setattr(
        gpu_suite, "_ops_rows", lambda *args: ["| m | 4 | nonprivate | 63 | 1.00 |"]
    )
    monkeypatch.setattr(
        gpu_suite.gpu_sections,
        "chunk_rows",
        lambda *args: ["| d | auto | 96 | cached | 1 | 2 | 1 | ok |"],
    )
    monkeypatch.setattr(
        gpu_suite.gpu_sections,
        "compiled_step_rows",
        lambda *args: ["| m | 4 | nonprivate | torch | 1 |"],
    )
    partial: list[str] = []
    report, passed = gpu_suite.run_suite(
        "cpu", ["papernot-cnn"], log=lambda _: None, progress=partial.append
    )
    assert not passed and len(partial) == 8 and partial[-1] == report
    assert "## 1. Engines" in partial[0] and "## 2." not in partial[0]
    assert (
        "| error: RuntimeError: CUDA out of memory | FAIL |" in report
        and "second line" not in report
    )
    assert report.index("## 4. Step time") < report.index("## 5. The training loop")


def test_sync_sites_name_the_lines_that_synchronised_most_often_per_step():
    import traceback

    from dpscale.bench.gpu_suite import sync_site, sync_sites

    def frame(filename: str, lineno: int) -> traceback.FrameSummary:
        return traceback.FrameSummary(filename, lineno, "f")

    stack = [
        frame("/r/src/dpscale/bench/gpu_suite.py", 9),
        frame("/r/src/dpscale/train/step.py", 201),
        frame("/r/torch/optim/sgd.py", 40),
    ]
    ours = sync_site("/r/src/dpscale/train/step.py", 185, stack)
    theirs = sync_site("/r/torch/optim/sgd.py", 40, stack)
    assert (ours, theirs) == ("step.py:185", "sgd.py:40 via step.py:201")
    # the suite's own frames skipped
    assert sync_site("/r/torch/cuda/__init__.py", 7, stack[:1]) == "__init__.py:7"
    assert (
        sync_sites([ours] * 6 + [theirs] * 2, steps=2)
        == "step.py:185 x3.0, sgd.py:40 via step.py:201 x1.0"
    )
    assert sync_sites([], steps=20) == "none"


def test_cuda_on_a_torch_without_it_is_one_line(tmp_path, capsys, monkeypatch):
    """``make gpu-check`` on a CPU-only torch printed CUDA's traceback (issue 62, item 11): now one
    line, exit 2, and no report; a CUDA build that sees no GPU, and a device torch does not know, too."""
    import torch

    from helpers import one_line_error

    out = tmp_path / "report.md"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    one_line_error(
        capsys,
        ["bench", "gpu-suite", "--device", "cuda", "--out", str(out)],
        "no CUDA in this torch build",
        "install a CUDA torch, or use --device cpu",
    )
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    one_line_error(
        capsys,
        ["bench", "gpu-suite", "--device", "cuda:1"],
        "has CUDA 12.8 but sees no CUDA device",
    )
    one_line_error(
        capsys,
        ["bench", "gpu-suite", "--device", "gpu"],
        "--device must be cuda, cuda:<index> or cpu",
    )
    assert not out.exists()


def test_a_compiled_row_is_timed_against_eager_and_one_that_does_not_run_fails(monkeypatch):
    """Section 8 where the suite compiles (CUDA, or a CPU without --quick), the bench stubbed: a
    compiled row's time as a ratio to the eager row's; a compiled row the bench skipped is a FAIL
    row with the bench's reason; the tuner's provenance lines follow the table."""
    import torch

    from dpscale.bench import gpu_sections, step_time
    from dpscale.bench.step_time import Row

    def bench(models, engines, *, batch_size, log, **options):
        assert models == ["papernot-cnn"] and engines[:3] == [
            "nonprivate",
            "dpscale-auto",
            "dpscale-auto-compiled",
        ]
        log(
            f"papernot-cnn B={batch_size} dpscale-auto clip methods: conv1 gram (cached 2026-11-28, timed idle)"
        )
        rows = [
            Row("papernot-cnn", batch_size, "nonprivate", 2.0, 1.0, 1.0, 2),
            Row("papernot-cnn", batch_size, "dpscale-auto", 8.0, 4.0, 2.0, 2, "GhostEngine"),
        ]
        if batch_size == 4:
            return [
                *rows,
                Row("papernot-cnn", 4, "dpscale-auto-compiled", 2.0, 1.0, 3.0, 2, "CompiledEngine"),
            ]
        log("skip papernot-cnn dpscale-auto-compiled: ValueError: compile: could not capture")
        return rows

    monkeypatch.setattr(gpu_sections, "compiles", lambda dev, quick: True)
    monkeypatch.setattr(step_time, "run_step_time", bench)
    lines = gpu_sections.compiled_step_rows(
        torch.device("cpu"), ["papernot-cnn", "linear"], quick=True
    )
    assert (
        "| papernot-cnn | 4 | dpscale-auto-compiled | CompiledEngine | 2.0 | 1.00 | 0.25 | 3.0 | |"
        in lines
    )
    assert "| papernot-cnn | 8 | dpscale-auto | GhostEngine | 8.0 | 4.00 |  | 2.0 | |" in lines
    skipped = "| papernot-cnn | 8 | dpscale-auto-compiled | skip papernot-cnn dpscale-auto-compiled: ValueError: compile: "
    assert skipped + "could not capture | | | | | FAIL |" in lines
    assert (
        "- tuner: papernot-cnn B=4 dpscale-auto clip methods: conv1 gram (cached 2026-11-28, timed idle)"
        in lines
    )


@pytest.mark.slow
def test_what_quick_leaves_out_on_a_cpu_compiles_and_passes(monkeypatch):
    """The compiled rows the CPU's --quick form leaves out, compiled for real (~2 min on the 2-core
    VM, inductor's cache cold): section 5's compiled Trainer run trains to the eager runs' end,
    section 6 counts the compiled step, section 8 times it beside eager at B = 4 and 8."""
    import torch

    from dpscale.bench import gpu_sections, gpu_suite

    monkeypatch.setattr(gpu_sections, "compiles", lambda dev, quick: True)
    cpu = torch.device("cpu")
    training = gpu_suite.training_rows(cpu, None, True)
    assert training[-1].startswith("| mnist-5k (embedded), 6 steps, chunks of 16, compiled | 6 |")
    assert all(row.endswith("ok |") for row in training) and len(training) == 3
    assert any(
        line.startswith("| papernot-cnn | 4 | dpscale-auto-compiled |")
        for line in gpu_suite._ops_rows(cpu, ["papernot-cnn"], True)
    )
    timed = gpu_sections.compiled_step_rows(cpu, ["papernot-cnn"], True)
    assert sum("| dpscale-auto-compiled | CompiledEngine |" in line for line in timed) == 2
    assert not any("FAIL" in line for line in timed)

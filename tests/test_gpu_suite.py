"""The device acceptance suite's CPU form (issue 44): every section runs and passes at tiny sizes,
the report is one markdown file, and a failing check turns the exit code to 1."""

from __future__ import annotations

from dpscale.cli import main


def test_the_cpu_form_of_the_device_suite_passes_and_writes_its_report(tmp_path):
    out = tmp_path / "report.md"
    assert main(["bench", "gpu-suite", "--device", "cpu", "--quick", "--batch", "4", "--out", str(out)]) == 0
    report = out.read_text()
    for section in ("## 1. Engines", "## 2. The clip bound in 16-bit", "## 3. make_private on the device",
                    "## 4. Step time", "## 5. The training loop", "## 6. Operators per step"):  # fmt: skip
        assert section in report
    checks = [line for line in report.splitlines() if line.startswith("| ") and line.rstrip().endswith(("ok |", "FAIL |"))]
    assert len(checks) >= 4 + 8 + 3 + 1 and all(line.endswith("ok |") for line in checks)
    assert "| mnist-5k (embedded), 6 steps, chunks of 16 | 6 |" in report
    assert "| mnist-5k (embedded), 6 steps, chunks of 64 | 6 |" in report


def test_a_failing_check_fails_the_suite(tmp_path, monkeypatch):
    from dpscale.bench import gpu_suite

    monkeypatch.setattr(gpu_suite, "worst_single_example_norm", lambda *args: 1.5)  # a bound broken on the device
    out = tmp_path / "report.md"
    assert main(["bench", "gpu-suite", "--device", "cpu", "--quick", "--batch", "2", "--out", str(out)]) == 1
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
    monkeypatch.setattr(gpu_suite, "training_rows", lambda *args: ["| d | 1 | 1 | n/a | n/a | 50% | 1 | ok |"])
    monkeypatch.setattr(gpu_suite, "_ops_rows", lambda *args: ["| m | 4 | nonprivate | 63 | 1.00 |"])
    partial: list[str] = []
    report, passed = gpu_suite.run_suite("cpu", ["papernot-cnn"], log=lambda _: None, progress=partial.append)
    assert not passed and len(partial) == 6 and partial[-1] == report
    assert "## 1. Engines" in partial[0] and "## 2." not in partial[0]
    assert "| error: RuntimeError: CUDA out of memory | FAIL |" in report and "second line" not in report
    assert report.index("## 4. Step time") < report.index("## 5. The training loop")


def test_sync_sites_name_the_lines_that_synchronised_most_often_per_step():
    import traceback

    from dpscale.bench.gpu_suite import sync_site, sync_sites

    def frame(filename: str, lineno: int) -> traceback.FrameSummary:
        return traceback.FrameSummary(filename, lineno, "f")

    stack = [frame("/r/src/dpscale/bench/gpu_suite.py", 9), frame("/r/src/dpscale/train/step.py", 201),
             frame("/r/torch/optim/sgd.py", 40)]  # fmt: skip
    ours = sync_site("/r/src/dpscale/train/step.py", 185, stack)
    theirs = sync_site("/r/torch/optim/sgd.py", 40, stack)
    assert (ours, theirs) == ("step.py:185", "sgd.py:40 via step.py:201")
    assert sync_site("/r/torch/cuda/__init__.py", 7, stack[:1]) == "__init__.py:7"  # the suite's own frames skipped
    assert sync_sites([ours] * 6 + [theirs] * 2, steps=2) == "step.py:185 x3.0, sgd.py:40 via step.py:201 x1.0"
    assert sync_sites([], steps=20) == "none"


def test_cuda_on_a_torch_without_it_is_one_line(tmp_path, capsys, monkeypatch):
    """``make gpu-check`` on a CPU-only torch printed CUDA's traceback (issue 62, item 11): now one
    line, exit 2, and no report; a CUDA build that sees no GPU, and a device torch does not know, too."""
    import torch

    from helpers import one_line_error

    out = tmp_path / "report.md"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    one_line_error(capsys, ["bench", "gpu-suite", "--device", "cuda", "--out", str(out)],
                   "no CUDA in this torch build", "install a CUDA torch, or use --device cpu")  # fmt: skip
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    one_line_error(capsys, ["bench", "gpu-suite", "--device", "cuda:1"], "has CUDA 12.8 but sees no CUDA device")
    one_line_error(capsys, ["bench", "gpu-suite", "--device", "gpu"], "--device must be cuda, cuda:<index> or cpu")
    assert not out.exists()

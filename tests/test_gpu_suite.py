"""The device acceptance suite's CPU form (issue 44): every section runs and passes at tiny sizes,
the report is one markdown file, and a failing check turns the exit code to 1."""

from __future__ import annotations

from dpscale.cli import main


def test_the_cpu_form_of_the_device_suite_passes_and_writes_its_report(tmp_path):
    out = tmp_path / "report.md"
    assert main(["bench", "gpu-suite", "--device", "cpu", "--quick", "--batch", "4", "--out", str(out)]) == 0
    report = out.read_text()
    for section in ("## 1. Engines", "## 2. The clip bound in 16-bit", "## 3. make_private on the device",
                    "## 4. Step time", "## 5. The training loop"):  # fmt: skip
        assert section in report
    checks = [line for line in report.splitlines() if line.startswith("| ") and line.rstrip().endswith(("ok |", "FAIL |"))]
    assert len(checks) >= 4 + 8 + 3 + 1 and all(line.endswith("ok |") for line in checks)
    assert "| mnist-5k (embedded), 6 steps | 6 |" in report


def test_a_failing_check_fails_the_suite(tmp_path, monkeypatch):
    from dpscale.bench import gpu_suite

    monkeypatch.setattr(gpu_suite, "worst_single_example_norm", lambda *args: 1.5)  # a bound broken on the device
    out = tmp_path / "report.md"
    assert main(["bench", "gpu-suite", "--device", "cpu", "--quick", "--batch", "2", "--out", str(out)]) == 1
    assert "| 1.500000000 | " in out.read_text() and "FAIL" in out.read_text()

"""What a finished run hands on (issue 30): TensorBoard events, ``dpscale plot`` PNGs and
``dpscale export`` files, checked against the run's own metrics.jsonl and summary.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpscale.cli import main
from dpscale.export import card_path
from dpscale.runs import read_metrics

STEPS = 20


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A short private run on the embedded MNIST sample (papernot-cnn, 20 steps, EMA on)."""
    out = tmp_path_factory.mktemp("run") / "run"
    sets = [
        "model.name=papernot-cnn",
        "dp.batch_size=16",
        f"train.steps={STEPS}",
        "train.ema_decay=0.9",
        "run.seed=0",
        f"run.out_dir={out}",
    ]
    assert main(["train", "--quiet", *(a for s in sets for a in ("--set", s))]) == 0
    return out


def _events(run_dir: Path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(
        str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}
    )
    board.Reload()
    return board


def test_tensorboard_holds_the_run_scalars_and_its_privacy_statement(run_dir):
    board = _events(run_dir)
    for tag in (
        "train/loss",
        "train/clipped_fraction",
        "train/mean_grad_norm",
        "train/lr",
        "time/step_ms",
    ):
        assert [e.step for e in board.Scalars(tag)] == [10, 20], tag
    assert all(0.0 <= e.value <= 1.0 for e in board.Scalars("train/clipped_fraction"))
    assert all(e.value > 0 for e in board.Scalars("train/mean_grad_norm"))
    last = read_metrics(run_dir)[-1]
    summary = json.loads((run_dir / "summary.json").read_text())
    for tag, key in [
        ("test/accuracy", "test_accuracy"),
        ("test/accuracy_ema", "test_accuracy_ema"),
        ("privacy/epsilon", "epsilon"),
        ("test/loss", "test_loss"),
    ]:
        event = board.Scalars(tag)[-1]
        assert event.step == STEPS and event.value == pytest.approx(last[key], rel=1e-6), tag
    assert board.Scalars("privacy/epsilon")[-1].value == pytest.approx(summary["epsilon"], rel=1e-6)
    texts = {
        tag: board.Tensors(tag)[0].tensor_proto.string_val[0].decode()
        for tag in board.Tags()["tensors"]
    }
    config_tag = next(t for t in texts if t.startswith("config"))
    privacy_tag = next(t for t in texts if t.startswith("privacy"))
    assert "papernot-cnn" in texts[config_tag] and "batch_size: 16" in texts[config_tag]
    assert "epsilon" in texts[privacy_tag] and "delta" in texts[privacy_tag]


def test_tensorboard_off_writes_no_events(tmp_path):
    out = tmp_path / "run"
    sets = [
        "model.name=papernot-cnn",
        "dp.batch_size=16",
        "train.steps=2",
        "run.tensorboard=false",
        f"run.out_dir={out}",
    ]
    assert main(["train", "--quiet", *(a for s in sets for a in ("--set", s))]) == 0
    assert (out / "summary.json").is_file() and not (out / "tensorboard").exists()


def test_dpscale_plot_writes_valid_pngs_of_overlaid_runs(run_dir, tmp_path):
    out = tmp_path / "plots"
    assert main(["plot", str(run_dir), str(run_dir), "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["accuracy.png", "epsilon.png", "epsilon_delta.png", "loss.png", "tradeoff.png"]
    for path in out.iterdir():
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) > 5000, (
            path.name
        )


def test_the_tradeoff_curve_is_the_summarys_odds(run_dir, monkeypatch):
    """tradeoff.png draws, at the reported false-positive rates, exactly summary.json's TPR bounds."""
    from dpscale import plots
    from dpscale.privacy.accounting import tradeoff

    drawn = {}
    real = tradeoff.tpr_at_fpr
    monkeypatch.setattr(
        tradeoff, "tpr_at_fpr", lambda profile, fprs: drawn.update(real(profile, fprs)) or drawn
    )
    monkeypatch.setattr(plots, "CURVE_FPRS", (0.001, 0.01, 0.1))
    plots._tradeoff([run_dir], run_dir.parent / "tradeoff-check.png")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {f"{a:g}": t for a, t in drawn.items()} == pytest.approx(
        summary["tpr_at_fpr"], rel=1e-12
    )


def test_the_epsilon_delta_curve_uses_the_accountant_numbers(run_dir):
    from dpscale.plots import _final_accountant

    accountant, delta = _final_accountant(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    curve = accountant.epsilons([1e-8, delta, 1e-3])
    assert curve[1] == pytest.approx(summary["epsilon"], rel=1e-12)
    assert curve == [accountant.epsilon(d) for d in (1e-8, delta, 1e-3)]
    assert curve[0] > curve[1] > curve[2]  # epsilon falls as delta grows


def test_plot_refuses_a_directory_that_is_no_run(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "not a dpscale run directory" in capsys.readouterr().err


# A fresh interpreter: loads the export with no dpscale training code (dpscale.train never imported)
# and computes its accuracy on the run's test images, prepared as the run prepared them.
_FRESH = r"""
import json, sys
import torch
fmt, path, data_file = sys.argv[1:4]
test = torch.load(data_file)
if fmt == "onnx":
    import numpy as np, onnxruntime
    session = onnxruntime.InferenceSession(path)
    logits = np.concatenate([session.run(None, {"images": test["x"][i : i + 1000].numpy()})[0]
                             for i in range(0, len(test["x"]), 1000)])
    accuracy = float((torch.from_numpy(logits).argmax(1) == test["y"]).double().mean())
    from dpscale.exported import read_metadata
    metadata = read_metadata(path)
elif fmt == "torchscript":
    extra = {"dpscale.json": ""}
    model = torch.jit.load(path, _extra_files=extra)
    metadata = json.loads(extra["dpscale.json"])
    from dpscale.exported import accuracy as top1
    accuracy = top1(model, test["x"], test["y"])
else:
    from dpscale.exported import accuracy as top1, load_exported
    model, metadata = load_exported(path)
    accuracy = top1(model, test["x"], test["y"])
assert not any(m.startswith("dpscale.train") for m in sys.modules), [m for m in sys.modules if "dpscale.train" in m]
print(json.dumps({"accuracy": accuracy, "metadata": metadata}))
"""


@pytest.mark.parametrize("fmt", ["safetensors", "torchscript", "onnx"])
def test_an_export_reproduces_the_run_test_accuracy_in_a_fresh_process(run_dir, tmp_path, fmt):
    import subprocess
    import sys

    import torch

    from dpscale.data.datasets import load_dataset

    pytest.importorskip(
        {"safetensors": "safetensors", "torchscript": "torch", "onnx": "onnxruntime"}[fmt]
    )
    if fmt == "onnx":
        pytest.importorskip("onnxscript")
    path = tmp_path / f"model.{fmt}"
    path = path.with_suffix(
        {"safetensors": ".safetensors", "torchscript": ".pt", "onnx": ".onnx"}[fmt]
    )
    assert main(["export", str(run_dir), "--format", fmt, "--out", str(path)]) == 0
    test = load_dataset("mnist-5k", None)  # the run's data, in [0, 1]: the export normalises itself
    torch.save({"x": test.x_test, "y": test.y_test}, tmp_path / "test.pt")
    done = subprocess.run(
        [sys.executable, "-c", _FRESH, fmt, str(path), str(tmp_path / "test.pt")],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    summary = json.loads((run_dir / "summary.json").read_text())
    # exactly: the same weights and arithmetic
    assert result["accuracy"] == summary["test_accuracy"]
    metadata = result["metadata"]
    assert (
        metadata["privacy"]["epsilon"] == summary["epsilon"]
        and metadata["privacy"]["delta"] == summary["delta"]
    )
    assert (
        metadata["test_accuracy"] == summary["test_accuracy"]
        and metadata["model"]["name"] == "papernot-cnn"
    )
    assert (
        metadata["privacy"]["accountant"] == summary["accountant"]
        and "guarantee_caveats" in metadata["privacy"]
    )
    card = card_path(path).read_text()  # its own card, beside it
    assert f"{summary['epsilon']}" in card and "papernot-cnn" in card


def test_an_export_holds_no_optimizer_rng_or_accountant_state(run_dir, tmp_path):
    pytest.importorskip("safetensors")
    from safetensors import safe_open

    path = tmp_path / "m.safetensors"
    assert main(["export", str(run_dir), "--ema", "--out", str(path)]) == 0
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        metadata = json.loads(f.metadata()["dpscale"])
    from dpscale.models import build_model

    assert keys == set(build_model("papernot-cnn", 10, (1, 28, 28), "tanh").state_dict())
    assert metadata["weights"] == "ema"
    assert (
        metadata["test_accuracy"]
        == json.loads((run_dir / "summary.json").read_text())["test_accuracy_ema"]
    )


def test_export_refuses_ema_without_an_ema_model(tmp_path, capsys):
    out = tmp_path / "run"
    sets = [
        "model.name=papernot-cnn",
        "dp.batch_size=16",
        "train.steps=2",
        "run.tensorboard=false",
        f"run.out_dir={out}",
    ]
    assert main(["train", "--quiet", *(a for s in sets for a in ("--set", s))]) == 0
    assert main(["export", str(out), "--ema"]) == 2
    assert "no EMA model" in capsys.readouterr().err


def test_export_refuses_a_run_on_images_with_its_own_input_normalisation(tmp_path, capsys):
    # A centred (or GroupNorm-ed) run on pixels: the export could not reproduce its inputs.
    out = tmp_path / "run"
    sets = [
        "model.name=papernot-cnn",
        "dp.batch_size=16",
        "train.steps=2",
        "run.tensorboard=false",
        "features.center=true",
        f"run.out_dir={out}",
    ]
    assert main(["train", "--quiet", *(a for s in sets for a in ("--set", s))]) == 0
    assert main(["export", str(out)]) == 2
    assert "features.normalize or features.center" in capsys.readouterr().err


def test_evaluate_exported_gives_the_run_test_accuracy(run_dir, tmp_path):
    pytest.importorskip("safetensors")
    from dpscale.exported import evaluate_exported

    path = tmp_path / "m.safetensors"
    assert main(["export", str(run_dir), "--out", str(path)]) == 0
    assert (
        evaluate_exported(path)
        == json.loads((run_dir / "summary.json").read_text())["test_accuracy"]
    )


def test_a_lora_run_exports_the_plain_model_with_the_run_accuracy(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors import safe_open

    from dpscale.exported import evaluate_exported
    from dpscale.models import build_model

    out = tmp_path / "lora"
    sets = [
        "model.name=papernot-cnn",
        "model.peft=lora",
        "model.lora_rank=2",
        "dp.batch_size=16",
        "train.steps=3",
        "run.tensorboard=false",
        f"run.out_dir={out}",
    ]
    assert main(["train", "--quiet", *(a for s in sets for a in ("--set", s))]) == 0
    path = tmp_path / "m.safetensors"
    assert main(["export", str(out), "--out", str(path)]) == 0
    with safe_open(str(path), framework="pt") as f:
        # merged
        assert set(f.keys()) == set(
            build_model("papernot-cnn", 10, (1, 28, 28), "tanh").state_dict()
        )
    assert (
        evaluate_exported(path) == json.loads((out / "summary.json").read_text())["test_accuracy"]
    )


def _scatternet_run(tmp_path: Path, normalize: str, center: bool = False) -> tuple[Path, dict]:
    out = tmp_path / "scatter"
    # Pixels in [0, 1] as the ScatterNet presets read them (and test_features_train's runs: one feature cache).
    sets = [
        "features.extractor=scatternet",
        "data.normalize=false",
        f"features.normalize={normalize}",
        "features.groups=27",
        f"features.center={str(center).lower()}",
        "model.name=scatter-linear",
        "dp.batch_size=64",
        "train.steps=4",
        "run.tensorboard=false",
        f"run.out_dir={out}",
    ]
    assert main(["train", "--quiet", *(a for s in sets for a in ("--set", s))]) == 0
    return out, json.loads((out / "summary.json").read_text())


def _exported_accuracy(run_dir: Path, tmp_path: Path, fmt: str) -> tuple[float, dict]:
    """Export ``run_dir`` as ``fmt`` and evaluate it in a fresh process (``_FRESH``) on the raw test images."""
    import subprocess
    import sys

    import torch

    from dpscale.data.datasets import load_dataset

    test = load_dataset("mnist-5k", None)
    torch.save({"x": test.x_test, "y": test.y_test}, tmp_path / "test.pt")
    path = tmp_path / f"m.{fmt}"
    assert main(["export", str(run_dir), "--format", fmt, "--out", str(path)]) == 0
    done = subprocess.run(
        [sys.executable, "-c", _FRESH, fmt, str(path), str(tmp_path / "test.pt")],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["accuracy"], result["metadata"]


@pytest.mark.parametrize(("normalize", "center"), [("datanorm", True), ("groupnorm", False)])
def test_a_scatternet_run_exports_features_and_head_with_the_run_accuracy(
    tmp_path, normalize, center
):
    """The export takes images: ScatterNet, the feature normalisation (Data Normalization's
    released statistics and the released centring mean included) and the head, reproducing the
    run's accuracy exactly."""
    pytest.importorskip("safetensors")
    run_dir, summary = _scatternet_run(tmp_path, normalize, center)
    assert summary["feature_centering"] is center
    if center:  # in a fresh process: the export needs nothing of the run's
        accuracy, metadata = _exported_accuracy(run_dir, tmp_path, "safetensors")
    else:
        from dpscale.exported import evaluate_exported, read_metadata

        assert (
            main(
                [
                    "export",
                    str(run_dir),
                    "--format",
                    "safetensors",
                    "--out",
                    str(tmp_path / "m.safetensors"),
                ]
            )
            == 0
        )
        accuracy, metadata = (
            evaluate_exported(tmp_path / "m.safetensors"),
            read_metadata(tmp_path / "m.safetensors"),
        )
    assert accuracy == summary["test_accuracy"]
    assert metadata["features"]["normalize"] == normalize and metadata["input"]["shape"] == [
        1,
        28,
        28,
    ]
    assert (
        metadata["features"]["center"] is center
        and ("feature-mean" in (summary["epsilon_parts"] or {})) is center
    )
    assert ("mean feature vector" in card_path(tmp_path / "m.safetensors").read_text()) is center
    assert (
        main(["export", str(run_dir), "--format", "torchscript", "--out", str(tmp_path / "m.pt")])
        == 2
    )


@pytest.mark.slow  # the ONNX exporter takes ~165 s over the ScatterNet's graph on 2 cores
def test_a_scatternet_run_exports_to_onnx_with_the_run_accuracy(tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    run_dir, summary = _scatternet_run(tmp_path, "datanorm")
    accuracy, metadata = _exported_accuracy(run_dir, tmp_path, "onnx")
    assert accuracy == summary["test_accuracy"] and metadata["features"]["normalize"] == "datanorm"

"""Deploying an exported model (issue 42): a run still training or unfinished is refused unless
``--allow-partial`` (its card then says so), class names are carried, one card per exported file,
no local path in anything shipped, the dpscale version recorded, and an ONNX export that prints
nothing but its result."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import dpscale
from dpscale.cli import main
from dpscale.exported import read_metadata

CLASSES = ["cat", "dog", "zebra"]  # folder names; sorted, as the loader labels them
PLANNED, STOPPED_AT = 4, 2  # the partial run's planned steps and where it stopped


def _image_folder(root: Path) -> Path:
    """root/{train,test}/<class>/*.png: 8x8 RGB images, 10 training and 4 test images per class."""
    rng = np.random.default_rng(0)
    for label, name in enumerate(CLASSES):
        for split, count in (("train", 10), ("test", 4)):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                # each class its own brightness
                pixels = rng.integers(0, 60, (8, 8, 3)) + 80 * label
                Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return _image_folder(tmp_path_factory.mktemp("data") / "pets")


@pytest.fixture(scope="module")
def partial_run(tmp_path_factory, folder) -> Path:
    """A run on the named folders planned for 4 steps, stopped at step 2 (as a killed run leaves it)."""
    out = tmp_path_factory.mktemp("runs") / "partial"
    sets = [
        "data.name=imagefolder",
        f"data.root={folder}",
        "model.name=linear",
        "dp.batch_size=8",
        f"train.steps={PLANNED}",
        "train.ema_decay=0.9",
        "run.tensorboard=false",
        "run.seed=0",
        f"run.out_dir={out}",
    ]
    args = [
        "train",
        "--quiet",
        "--max-steps",
        str(STOPPED_AT),
        *(a for s in sets for a in ("--set", s)),
    ]
    assert main(args) == 0
    assert not (out / "summary.json").exists()
    return out


@pytest.fixture(scope="module")
def finished_run(partial_run) -> Path:
    """The partial run, copied and trained to its planned end."""
    out = partial_run.parent / "finished"
    shutil.copytree(partial_run, out)
    assert main(["train", "--quiet", "--resume", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def exported(finished_run, tmp_path_factory) -> Path:
    """The finished run exported as safetensors, outside its run directory."""
    path = tmp_path_factory.mktemp("shipped") / "pets.safetensors"
    assert main(["export", str(finished_run), "--out", str(path)]) == 0
    return path


def _card(path: Path) -> str:
    from dpscale.export import card_path

    return card_path(path).read_text()


# --- a run still training, or not finished


_HOLD_LOCK = """
import sys
from dpscale.train.rundir import RunLock
RunLock(sys.argv[1]).acquire()
print("held", flush=True)
sys.stdin.read()
"""


def test_a_run_still_training_is_refused_naming_its_lock_holder_and_a_killed_one_is_not(
    finished_run, tmp_path, capsys
):
    """Another process holds the run's lock (as `dpscale train` does): refused, naming it. Once
    that process is killed its lock file stays, held by nobody: that is no live run."""
    pytest.importorskip("fcntl")
    out = tmp_path / "m.safetensors"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(finished_run)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["export", str(finished_run), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert (
            f"{finished_run} is still training (pid {holder.pid} on " in err
            and "--allow-partial" in err
        )
        assert len(err.strip().splitlines()) == 1 and not out.exists()
    finally:
        holder.kill()  # SIGKILL: the lock is never released, its file stays
        holder.wait()
    try:
        assert f"pid {holder.pid}" in (finished_run / ".dpscale.lock").read_text()
        assert main(["export", str(finished_run), "--out", str(out)]) == 0
        assert read_metadata(out)["partial"] is False and "partial" not in _card(out)
    finally:
        (finished_run / ".dpscale.lock").unlink()


def test_allow_partial_exports_a_run_still_training_and_its_card_says_partial(
    partial_run, tmp_path, capsys
):
    from dpscale.train.rundir import RunLock

    pytest.importorskip("fcntl")
    out = tmp_path / "m.safetensors"
    lock = RunLock(partial_run)  # held as its training process holds it
    lock.acquire()
    try:
        assert main(["export", str(partial_run), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"is still training (pid {os.getpid()} on " in err
        assert f"newest checkpoint is step {STOPPED_AT} of {PLANNED}" in err and not out.exists()
        assert main(["export", str(partial_run), "--out", str(out), "--allow-partial"]) == 0
    finally:
        lock.release()
    note = f"partial: step {STOPPED_AT} of {PLANNED}"
    assert note in capsys.readouterr().out
    assert note in _card(out) and "while the run was still training" in _card(out)
    metadata = read_metadata(out)
    assert (metadata["step"], metadata["planned_steps"], metadata["partial"]) == (
        STOPPED_AT,
        PLANNED,
        True,
    )
    assert (
        metadata["exported_while_training"] is True and metadata["privacy"]["steps"] == STOPPED_AT
    )


def test_a_run_that_stopped_early_is_refused_naming_its_step_unless_allow_partial(
    partial_run, tmp_path, capsys
):
    """No process trains in it (a lock file left by a killed run does not count): refused as unfinished."""
    out = tmp_path / "m.safetensors"
    (partial_run / ".dpscale.lock").write_text(
        "pid 999999 on elsewhere since 2020-01-01 00:00:00 UTC"
    )
    try:
        assert main(["export", str(partial_run), "--out", str(out)]) == 2
    finally:
        (partial_run / ".dpscale.lock").unlink()
    err = capsys.readouterr().err
    assert (
        f"stopped at step {STOPPED_AT} of {PLANNED} (not finished)" in err
        and "--allow-partial" in err
    )
    assert "still training" not in err and not out.exists()
    assert main(["export", str(partial_run), "--out", str(out), "--allow-partial"]) == 0
    assert f"partial: step {STOPPED_AT} of {PLANNED}" in _card(
        out
    ) and "after the run stopped" in _card(out)


def test_a_run_before_its_first_checkpoint_is_named_as_such(partial_run, tmp_path, capsys):
    from dpscale.train.rundir import RunLock

    pytest.importorskip("fcntl")
    started = tmp_path / "started"  # what a run leaves before its first checkpoint: config.yaml
    started.mkdir()
    shutil.copy(partial_run / "config.yaml", started / "config.yaml")
    assert main(["export", str(started)]) == 2
    err = capsys.readouterr().err
    assert "stopped before its first checkpoint" in err and "not a dpscale run directory" not in err
    lock = RunLock(started)
    lock.acquire()
    try:
        assert main(["export", str(started), "--allow-partial"]) == 2
    finally:
        lock.release()
    err = capsys.readouterr().err
    assert f"still training (pid {os.getpid()} on " in err and "has no checkpoint yet" in err
    assert sorted(p.name for p in started.iterdir()) == ["config.yaml"]  # nothing written


# --- what is shipped


def test_named_folders_are_the_export_classes(exported):
    assert read_metadata(exported)["classes"] == CLASSES
    assert "`cat`, `dog`, `zebra`" in _card(exported)


def test_a_class_subset_keeps_its_names_in_memory_and_streamed(folder):
    from dpscale.data.datasets import load_image_folder
    from dpscale.data.stream import open_stream
    from dpscale.data.subsets import select

    data = load_image_folder(folder)
    assert data.info.classes == tuple(CLASSES) == open_stream("imagefolder", folder).info.classes
    assert select(data, classes=[2, 0]).info.classes == ("zebra", "cat")
    # a meta-class is named by its members
    grouped = select(data, meta_classes=2, seed=0).info.classes
    assert len(grouped) == 2 and sorted("+".join(grouped).split("+")) == CLASSES


def test_the_export_records_the_dpscale_version(exported):
    assert read_metadata(exported)["dpscale_version"] == dpscale.__version__
    assert f"exported by dpscale {dpscale.__version__}" in _card(exported)


def test_the_metadata_and_card_give_the_guarantee_as_an_attackers_odds(exported):
    privacy = read_metadata(exported)["privacy"]
    assert set(privacy["tpr_at_fpr"]) == {"0.001", "0.01", "0.1"} and privacy["gdp_mu"] > 0
    card = _card(exported)
    assert privacy["odds"] in card and f"{100 * privacy['tpr_at_fpr']['0.01']:.2f}% at 1%" in card


def test_plain_and_ema_exports_leave_one_card_each(finished_run):
    assert main(["export", str(finished_run)]) == 0
    assert main(["export", str(finished_run), "--ema"]) == 0
    folder = finished_run / "export"
    assert sorted(p.name for p in folder.glob("*.md")) == [
        "model-ema.safetensors.card.md",
        "model.safetensors.card.md",
    ]
    for name, weights in (("model.safetensors", "final"), ("model-ema.safetensors", "ema")):
        card = _card(folder / name)
        assert f"File: `{name}`" in card and f"({weights} weights)" in card
        accuracy = read_metadata(folder / name)["test_accuracy"]
        assert f"Test accuracy {100 * accuracy:.2f}%" in card


def test_no_local_path_in_any_exported_file(finished_run, tmp_path, tmp_path_factory):
    """Every file shipped, every format, with its card: no run directory, data root or home directory."""
    pytest.importorskip("safetensors")
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    suffixes = {"safetensors": ".safetensors", "torchscript": ".pt", "onnx": ".onnx"}
    for fmt, suffix in suffixes.items():
        assert (
            main(
                [
                    "export",
                    str(finished_run),
                    "--format",
                    fmt,
                    "--out",
                    str(tmp_path / f"m{suffix}"),
                ]
            )
            == 0
        )
    # runs and data lie under the first
    local = [str(tmp_path_factory.getbasetemp()).encode(), str(Path.home()).encode()]
    for path in tmp_path.iterdir():
        data = path.read_bytes()
        assert not [p for p in local if p in data], path.name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        name for suffix in suffixes.values() for name in (f"m{suffix}", f"m{suffix}.card.md")
    )


def test_a_data_root_changed_on_resume_is_not_shipped_and_the_export_folder_is_owner_only(
    partial_run, folder, tmp_path
):
    """The privacy section quotes each --set of a resume, old and new value: a moved data root (a
    review found the old one in the safetensors header) is named as a local path, not shipped."""
    pytest.importorskip("safetensors")
    run, moved = tmp_path / "run", tmp_path / "moved" / "pets2"
    shutil.copytree(partial_run, run)
    shutil.copytree(folder, moved)
    assert main(["train", "--quiet", "--resume", str(run), "--set", f"data.root={moved}"]) == 0
    assert main(["export", str(run)]) == 0
    shipped = run / "export" / "model.safetensors"
    assert (shipped.parent.stat().st_mode & 0o777) == 0o700
    for path in (shipped, Path(f"{shipped}.card.md")):
        data = path.read_bytes()
        assert str(folder).encode() not in data and str(moved).encode() not in data, path.name


def test_the_onnx_export_prints_no_warning(finished_run, tmp_path, recwarn, monkeypatch):
    """No Python warning and no log record from torch at WARNING or above (the exporter logged
    four, one for each torchvision operator it skips when torchvision is not installed)."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    records: list[str] = []
    call_handlers = logging.Logger.callHandlers

    def seen(logger: logging.Logger, record: logging.LogRecord) -> None:
        # every record any logger lets through, whichever handlers torch set up (they change as it imports)
        if record.levelno >= logging.WARNING and record.name.startswith("torch"):
            records.append(f"{record.name}: {record.getMessage()}")
        call_handlers(logger, record)

    monkeypatch.setattr(logging.Logger, "callHandlers", seen)
    assert (
        main(["export", str(finished_run), "--format", "onnx", "--out", str(tmp_path / "m.onnx")])
        == 0
    )
    assert records == []
    assert [f"{w.category.__name__}: {w.message}" for w in recwarn] == []


def test_the_cards_evaluation_call_runs_for_an_image_folder_once_its_root_is_filled_in(
    exported, folder, finished_run
):
    """Issue 62, point 11: the card gave ``evaluate_exported("pets.safetensors")``, which fails for
    an image folder (an export names no local path); it now names the data root as a placeholder."""
    import json
    import re

    from dpscale import exported as exported_module

    call = re.search(r"`dpscale\.exported\.(evaluate_exported\([^`]*\))`", _card(exported)).group(1)
    assert 'data_root="<where imagefolder lies on this machine>"' in call
    filled = call.replace('"<where imagefolder lies on this machine>"', repr(str(folder)))
    filled = filled.replace(f'"{exported.name}"', repr(str(exported)))
    accuracy = eval(filled, {"evaluate_exported": exported_module.evaluate_exported})
    assert accuracy == json.loads((finished_run / "summary.json").read_text())["test_accuracy"]

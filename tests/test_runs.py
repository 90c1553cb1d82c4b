"""dpscale.runs, the one reader of run directories: the checks and readers on hand-made
directories (no training), that no other module spells a run file's name, and that a reader's
re-raise keeps its cause (what DPSCALE_DEBUG=1 shows)."""

import ast
import json
from pathlib import Path

import pytest

from dpscale import runs
from dpscale._io import DamagedFileError, save_checkpoint
from dpscale.config import load_config, save_config
from dpscale.errors import ConfigError
from dpscale.features.source_run import source_run_privacy

SRC = Path(__file__).resolve().parents[1] / "src" / "dpscale"
# The modules allowed to spell run file names: the reader, and the checkpoint writer below it.
NAMING_MODULES = {SRC / "runs.py", SRC / "_io.py"}
# Read summary.json by hand until they call runs.read_summary (tune/cli.py moves to cli/tan.py).
NOT_YET_MOVED: set = set()  # every module reads run files through dpscale.runs
FILE_NAMES = {
    runs.CONFIG_NAME,
    runs.CHECKPOINT_NAME,
    runs.PREVIOUS_CHECKPOINT_NAME,
    runs.METRICS_NAME,
    runs.SUMMARY_NAME,
    runs.AUDIT_NAME,
    runs.LOCK_NAME,
    runs.DAMAGED_CHECKPOINT_NAME,
}


def _run_dir(path: Path) -> Path:
    path.mkdir()
    save_config(load_config(None, ["train.steps=3"]), path / runs.CONFIG_NAME)
    return path


def _state(step: int) -> dict:
    return {"step": step}


def test_a_directory_without_a_config_is_not_a_run_directory(tmp_path):
    assert (
        not runs.is_run_dir(tmp_path)
        and not runs.holds_run(tmp_path)
        and not runs.holds_checkpoint(tmp_path)
    )
    with pytest.raises(
        runs.NotARunDirectory, match=r"is not a dpscale run directory \(no config.yaml\)"
    ):
        runs.read_run_config(tmp_path)
    # callers catching ConfigError still see it
    assert isinstance(runs.NotARunDirectory("x"), ConfigError)


def test_the_config_is_read_with_overrides_and_the_directory_where_it_is_now(tmp_path):
    run_dir = _run_dir(tmp_path / "moved")
    assert (
        runs.is_run_dir(run_dir) and runs.holds_run(run_dir) and not runs.holds_checkpoint(run_dir)
    )
    config = runs.read_run_config(run_dir, ["train.steps=5"])
    assert config.train.steps == 5 and config.run.out_dir == str(run_dir)


def test_the_newest_intact_checkpoint_falls_back_on_the_previous_one(tmp_path):
    run_dir = _run_dir(tmp_path / "r")
    assert runs.latest_checkpoint(run_dir).state is None  # stopped before its first checkpoint
    save_checkpoint(run_dir / runs.CHECKPOINT_NAME, _state(1))
    save_checkpoint(run_dir / runs.CHECKPOINT_NAME, _state(2))  # keeps step 1 as the previous one
    assert (
        runs.latest_checkpoint(run_dir).state["step"] == 2
        and runs.read_run(run_dir)[1]["step"] == 2
    )
    (run_dir / runs.CHECKPOINT_NAME).write_bytes(b"not a checkpoint")
    latest = runs.latest_checkpoint(run_dir)
    assert (
        latest.state["step"] == 1
        and latest.damaged == run_dir / runs.CHECKPOINT_NAME
        and "previous" in latest.note
    )
    with pytest.raises(DamagedFileError, match="continues from it") as caught:
        runs.read_run(run_dir)  # never falls back: the run as it stands
    assert isinstance(caught.value.__cause__, DamagedFileError)


def test_summary_and_metrics_are_read_back(tmp_path):
    run_dir = _run_dir(tmp_path / "r")
    assert runs.read_summary(run_dir) is None and runs.read_metrics(run_dir) == []
    (run_dir / runs.SUMMARY_NAME).write_text(json.dumps({"epsilon": 1.5}))
    # the last line cut by a crash
    (run_dir / runs.METRICS_NAME).write_text('{"step": 1}\n{"step": 2}\n{"st')
    assert runs.read_summary(run_dir) == {"epsilon": 1.5}
    assert [record["step"] for record in runs.read_metrics(run_dir)] == [1, 2]
    (run_dir / runs.SUMMARY_NAME).write_text("{")
    with pytest.raises(DamagedFileError, match="not valid JSON"):
        runs.read_summary(run_dir)


def test_a_source_run_that_cannot_be_read_keeps_the_cause(tmp_path):
    with pytest.raises(ConfigError, match="is not a dpscale run directory") as caught:
        source_run_privacy("init", str(tmp_path), str(tmp_path), False, lambda normalize: "")
    chain = [type(caught.value.__cause__), type(caught.value.__cause__.__cause__)]
    # the reader's one-line error, then its cause
    assert chain == [ConfigError, runs.NotARunDirectory]


def test_no_other_module_spells_a_run_file_name():
    spelled = [
        f"{path.relative_to(SRC)}:{node.lineno} {node.value!r}"
        for path in sorted(SRC.rglob("*.py"))
        if path not in NAMING_MODULES | NOT_YET_MOVED
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in FILE_NAMES
    ]
    assert spelled == []

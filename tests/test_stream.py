"""Streaming from image folders and prepared shards (data.loader=stream) against the in-memory loader.

The stream must change nothing but where pixels come from: the same batches, views and weights
as the in-memory run of the same seed, bit-identical resume, and clear errors naming bad files.
"""

import json
import shutil

import numpy as np
import pytest
import torch

from dpscale.cli import main
from dpscale.config import load_config
from dpscale.errors import ConfigError
from dpscale.data import DatasetError, load_dataset
from dpscale.data.shards import open_shards, prepare_shards
from dpscale.data.folder import SKIP_CORRUPT_HINT, list_image_folder
from dpscale.train.loop import Trainer
from datafiles import write_image_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_image_folder(tmp_path_factory.mktemp("jpegs"))


def _config(out_dir, root, loader, *extra, name="imagefolder"):
    return load_config(
        None,
        [
            f"data.name={name}",
            f"data.root={root}",
            f"data.loader={loader}",
            "data.workers=2",
            "model.name=papernot-cnn",
            "dp.batch_size=12",
            "dp.noise_multiplier=1.0",
            "dp.epsilon=null",
            "dp.max_grad_norm=1.0",
            "train.epochs=2",
            "train.max_physical_batch_size=5",
            "run.seed=3",
            f"run.out_dir={out_dir}",
            *extra,
        ]
        + ([] if name == "shards" else ["data.image_size=28"]),
    )


def _weights(trainer):
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def _assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _train(config):
    trainer = Trainer.create(config, progress=False)
    summary = trainer.run()
    return trainer, summary


@pytest.mark.parametrize("sampler", [(), ("dp.sampling=fixed",)], ids=["poisson", "fixed"])
def test_streamed_run_equals_in_memory_run_with_augmult_views(folder, tmp_path, sampler):
    """Every sampler (issue 45): the stream reads whatever indices it draws."""
    views = ["augment.multiplicity=2", "augment.type=crop-flip", *sampler]
    memory, summary_memory = _train(_config(tmp_path / "m", folder, "memory", *views))
    stream, summary_stream = _train(_config(tmp_path / "s", folder, "stream", *views))
    assert not memory.built.streamed and stream.built.streamed
    assert memory.step == stream.step == memory.total_steps > 2
    _assert_same_weights(_weights(memory), _weights(stream))
    assert summary_memory["test_accuracy"] == summary_stream["test_accuracy"]
    assert summary_memory["epsilon"] == summary_stream["epsilon"]
    assert summary_stream["data_loader"] == "stream" and summary_stream["data_wait_s"] >= 0


def test_eval_command_re_evaluates_a_streamed_run(folder, tmp_path, capsys):
    _, summary = _train(_config(tmp_path / "s", folder, "stream"))
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "s"), "--json"]) == 0
    assert (
        json.loads(capsys.readouterr().out.strip().splitlines()[-1])["test_accuracy"]
        == summary["test_accuracy"]
    )


@pytest.mark.parametrize(
    "mechanism",
    [(), ("dp.mechanism=bandmf", "dp.bands=2"), ("dp.sampling=fixed",)],
    ids=["dpsgd", "bandmf", "fixed"],
)
def test_stream_resumes_mid_epoch_bit_identically(folder, tmp_path, mechanism):
    whole, _ = _train(_config(tmp_path / "whole", folder, "stream", *mechanism))
    if mechanism:  # BandMF's cyclic sampler streams the batches the in-memory run draws
        memory, _ = _train(_config(tmp_path / "memory", folder, "memory", *mechanism))
        _assert_same_weights(_weights(whole), _weights(memory))
    config = _config(tmp_path / "parts", folder, "stream", *mechanism)
    first = Trainer.create(config, progress=False)
    draws = []
    sample = first.mechanism.sampler.sample
    first.mechanism.sampler.sample = lambda: draws.append(1) or sample()
    first.run(max_steps=3)  # the loader drew batches ahead of step 3; the checkpoint must not
    assert len(draws) > 3
    del first
    resumed = Trainer.resume(tmp_path / "parts", progress=False)
    assert resumed.step == 3
    resumed.run()
    _assert_same_weights(_weights(whole), _weights(resumed))


def test_prepared_shards_hold_the_folder_loaders_pixels_and_train_the_same(folder, tmp_path):
    listing = list_image_folder(folder, image_size=28)
    prepare_shards(listing, tmp_path / "shards", 28, workers=2)
    from_folder = load_dataset("imagefolder", folder, image_size=28)
    from_shards = load_dataset("shards", tmp_path / "shards")
    for key in ("x_train", "y_train", "x_test", "y_test"):
        assert torch.equal(getattr(from_folder, key), getattr(from_shards, key)), key
    assert from_shards.info.test_split == from_folder.info.test_split
    a, _ = _train(_config(tmp_path / "f", folder, "stream"))
    b, _ = _train(_config(tmp_path / "s", tmp_path / "shards", "stream", name="shards"))
    _assert_same_weights(_weights(a), _weights(b))


def test_data_prepare_and_verify_commands(folder, tmp_path, capsys):
    assert (
        main(
            [
                "data",
                "prepare",
                str(folder),
                str(tmp_path / "out"),
                "--size",
                "16",
                "--workers",
                "1",
                "--quiet",
            ]
        )
        == 0
    )
    assert "wrote 31 training and 5 test images (3x16x16" in capsys.readouterr().out
    assert main(["data", "verify", str(tmp_path / "out")]) == 0
    assert "every SHA-256 matches" in capsys.readouterr().out
    # not empty
    assert (
        main(["data", "prepare", str(folder), str(tmp_path / "out"), "--size", "16", "--quiet"])
        == 2
    )
    assert "exists and is not empty" in capsys.readouterr().err


@pytest.fixture
def shards(folder, tmp_path):
    prepare_shards(list_image_folder(folder, image_size=8), tmp_path / "shards", 8)
    return tmp_path / "shards"


def _edit_manifest(path, edit):
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: (p / "manifest.json").unlink(), "no manifest.json"),
        (lambda p: (p / "manifest.json").write_text("{not json"), "not valid JSON"),
        (lambda p: _edit_manifest(p, lambda m: m.update(version=99)), "manifest version 99"),
        (lambda p: _edit_manifest(p, lambda m: m.pop("classes")), "manifest has no 'classes'"),
        (
            lambda p: _edit_manifest(p, lambda m: m["splits"]["train"].update(count=5)),
            "shard counts add up to 31",
        ),
        (
            lambda p: _edit_manifest(
                p, lambda m: m["splits"]["train"]["shards"][0].update(count=30)
            ),
            "add up to 30",
        ),
        (lambda p: (p / "train-00000.npy").unlink(), "train-00000.npy is missing"),
        (
            lambda p: _flip_last_byte(p / "train-00000.npy"),
            "train-00000.npy does not match its SHA-256",
        ),
        (
            lambda p: _edit_manifest(p, lambda m: m.update(image_shape=[3, 9, 9])),
            "the manifest says uint8",
        ),
    ],
)
def test_a_bad_manifest_or_damaged_shards_are_refused(shards, damage, message):
    damage(shards)
    with pytest.raises(DatasetError, match="bad prepared data") as err:
        open_shards(shards)
    assert message in str(err.value)


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _corrupt_copy(folder, tmp_path):
    root = tmp_path / "corrupt"
    shutil.copytree(folder, root)
    (root / "class1" / "000.jpg").write_bytes(b"this is no image")  # unreadable header
    good = (root / "class2" / "005.jpg").read_bytes()
    (root / "class2" / "005.jpg").write_bytes(good[:-100])  # valid header, truncated pixels
    return root


def test_corrupt_images_are_an_error_naming_the_file(folder, tmp_path):
    root = _corrupt_copy(folder, tmp_path)
    with pytest.raises(DatasetError, match=r"class1/000\.jpg"):
        Trainer.create(_config(tmp_path / "r", root, "stream"), progress=False)
    (root / "class1" / "000.jpg").unlink()  # left: the truncated file, found when it is decoded
    with pytest.raises(DatasetError, match=r"class2/005\.jpg: image file is truncated"):
        Trainer.create(
            _config(tmp_path / "r2", root, "stream", "dp.batch_size=40"), progress=False
        ).run()


def test_a_file_that_breaks_during_training_stops_the_stream_naming_it(folder, tmp_path):
    from dpscale.privacy.sampling.samplers import PoissonSampler
    from dpscale.data.stream import StreamFeed, open_stream
    from dpscale.rng import DPRandom

    root = tmp_path / "copy"
    shutil.copytree(folder, root)
    data = open_stream("imagefolder", root, image_size=28)
    victim = data.train.files[-1]
    victim.write_bytes(victim.read_bytes()[:-100])
    sampler = PoissonSampler(len(data.train), 1.0, DPRandom(0))  # every example, every step
    feed = StreamFeed(
        data,
        sampler,
        chunk_size=7,
        start_step=0,
        total_steps=2,
        device=torch.device("cpu"),
        workers=2,
    )
    with pytest.raises(DatasetError, match=f"{victim.name}: image file is truncated"):
        list(feed.chunks(0))


def test_skip_corrupt_leaves_unreadable_images_out_counts_them_and_accounts_for_the_rest(
    folder, tmp_path, capsys
):
    root = _corrupt_copy(folder, tmp_path)
    for loader in ("memory", "stream"):
        # data.workers=0: the listing finds and leaves out the unreadable files, not the workers (whose
        # process start-up cost this test 10 s); the workers' own reading is tested above
        config = _config(
            tmp_path / loader, root, loader, "data.skip_corrupt=true", "data.workers=0"
        )
        trainer = Trainer.create(config, progress=True)
        info = trainer.data.info
        assert len(info.skipped_files) == 2 and any("000.jpg" in s for s in info.skipped_files)
        assert info.num_train + info.num_test == 34  # 36 files, 2 unreadable
        assert trainer.plan.dataset_size == info.num_train  # q = B / N of the images trained on
        assert "left out 2 unreadable file(s)" in capsys.readouterr().err
        summary = trainer.run()
        assert summary["steps"] == trainer.total_steps


def test_stream_config_errors_are_clear(folder, tmp_path):
    with pytest.raises(ConfigError, match="image folders and prepared shards"):
        load_config(None, ["data.loader=stream"])  # mnist-5k
    with pytest.raises(ConfigError, match="data.loader must be one of"):
        load_config(None, ["data.loader=disk"])
    with pytest.raises(ConfigError, match="features.extractor"):
        load_config(
            None,
            [
                "data.name=imagefolder",
                f"data.root={folder}",
                "data.loader=stream",
                "features.extractor=scatternet",
            ],
        )


def test_flat_validation_folder_with_a_label_file(folder, tmp_path):
    root = tmp_path / "imagenet"
    shutil.copytree(folder, root / "train")
    (root / "val").mkdir()
    lines = []
    for c in range(3):
        for i in range(2):
            name = f"val_{c}_{i}.jpg"
            shutil.copy(folder / f"class{c}" / f"{i:03d}.jpg", root / "val" / name)
            lines.append(f"{name},class{c}" if i else f"{name} {c}")
    (root / "labels.txt").write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError, match="data.val_labels"):
        list_image_folder(root)
    listing = list_image_folder(root, val_labels=root / "labels.txt")
    assert listing.test_split == "official" and len(listing.train_files) == 36
    assert listing.test_labels.tolist() == [0, 0, 1, 1, 2, 2]
    (root / "labels.txt").write_text("val_0_0.jpg dog\n")
    with pytest.raises(DatasetError, match="class 'dog'"):
        list_image_folder(root, val_labels=root / "labels.txt")


# 20 s of torchrun start-up: the one-process streamed/in-memory equivalence stays in the default suite.
@pytest.mark.slow
def test_two_process_streamed_run_equals_two_process_in_memory_run(folder, tmp_path):
    """Each rank streams only its shard of every batch; the job's result is the in-memory job's."""
    from helpers import run_job

    common = [
        "train",
        "--quiet",
        "--set",
        "data.name=imagefolder",
        "--set",
        f"data.root={folder}",
        "--set",
        "data.image_size=28",
        "--set",
        "data.workers=1",
        "--set",
        "dp.batch_size=12",
        "--set",
        "dp.noise_multiplier=1.0",
        "--set",
        "dp.epsilon=null",
        "--set",
        "train.steps=4",
        "--set",
        "train.max_physical_batch_size=4",
        "--set",
        "run.seed=5",
        "--set",
        "run.threads=1",
    ]
    for loader in ("memory", "stream"):
        run_job(
            2,
            *common,
            "--set",
            f"data.loader={loader}",
            "--set",
            f"run.out_dir={tmp_path / loader}",
        )
    memory, stream = (
        torch.load(tmp_path / d / "checkpoint.pt", weights_only=False) for d in ("memory", "stream")
    )
    assert stream["world_size"] == 2 and len(stream["rank_streams"]) == 2
    _assert_same_weights(memory["model"], stream["model"])
    samplers = [[r["sampler"] for r in run["rank_streams"]] for run in (memory, stream)]
    assert samplers[0] == samplers[1]  # each rank's sampler stands where the in-memory one stood


def test_auto_loader_on_a_small_folder_holds_what_the_memory_loader_holds(folder):
    from dpscale.data import dataset_fingerprint
    from dpscale.data.run_data import open_training_data, prepare_data

    auto = open_training_data(_config("/tmp/unused", folder, "auto"), torch.device("cpu"))
    memory = prepare_data(_config("/tmp/unused", folder, "memory"), torch.device("cpu"))
    assert not isinstance(
        auto,
        type(open_training_data(_config("/tmp/unused", folder, "stream"), torch.device("cpu"))),
    )
    for key in ("x_train", "y_train", "x_test", "y_test"):
        assert torch.equal(getattr(auto, key), getattr(memory, key)), key
    assert auto.info == memory.info and dataset_fingerprint(auto) == dataset_fingerprint(memory)


@pytest.mark.parametrize("split", ["train", "test"])
def test_a_truncated_png_read_by_a_loader_worker_is_one_line_naming_it(tmp_path, capsys, split):
    """Issue 62: a worker's DatasetError reached the CLI as torch's wrapped traceback (~3,000
    characters, flattened); it is the error's own sentence, as with the in-memory loader."""
    from PIL import Image

    from dpscale.data.stream import open_stream

    rng = np.random.default_rng(0)
    for c in range(2):
        (tmp_path / "pngs" / f"class{c}").mkdir(parents=True)
        for i in range(30):
            Image.fromarray(rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)).save(
                tmp_path / "pngs" / f"class{c}" / f"{i:03d}.png"
            )
    data = open_stream("imagefolder", tmp_path / "pngs")
    files = getattr(data, split).files
    # a file start-up never decodes (the set-up check's first 8, the fingerprint's 16 evenly spaced
    # training images): a loader worker finds it truncated
    read_at_start = (
        {*range(8), *np.linspace(0, len(files) - 1, num=16).astype(int)}
        if split == "train"
        else set()
    )
    victim = files[min(set(range(len(files))) - read_at_start)]
    victim.write_bytes(victim.read_bytes()[:-40])  # B = N below: every training image in every step
    argv = ["train", "--quiet"] + [
        a
        for kv in [
            "data.name=imagefolder",
            f"data.root={tmp_path / 'pngs'}",
            "data.loader=stream",
            "data.workers=1",
            "model.name=linear",
            f"dp.batch_size={len(data.train)}",
            "dp.noise_multiplier=1.0",
            "dp.epsilon=null",
            "train.steps=2",
            f"run.out_dir={tmp_path / 'run'}",
        ]
        for a in ("--set", kv)
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "\nDP-SGD:" in err and "Traceback" not in err  # past start-up: a worker read it
    assert err.splitlines()[-1] == (
        f"dpscale train: error: could not read image {victim}: image file is truncated ({SKIP_CORRUPT_HINT})"
    )

"""User-level DP through ``dpscale train`` (issue 43): user ids from an npz file or an IDX side
file, N = users in the plan and every output, whole users per chunk, and leave-one-USER-out within
C for DP-SGD, per-layer clipping and BandMF (two runs of one seed: the noise cancels); the same
images at the example unit move the release by more than C."""

from __future__ import annotations

import gzip
import json
import struct

import numpy as np
import pytest
import torch

from dpscale.config import load_config
from dpscale.privacy.sampling.units import user_groups
from dpscale.errors import ConfigError
from dpscale.train.hooks import RunHooks
from dpscale.train.loop import Trainer
from dpscale.train.seeds import run_seeds

C = 1.0
SIZES = [3, 1, 4, 2, 4, 3, 1, 2, 2, 3]  # images per user (k = 4 >= all: no subset draws)
USERS = len(SIZES)


def write_npz(path, drop: str | None = None, with_ids: bool = True):
    g = np.random.default_rng(0)
    n = sum(SIZES)
    ids = np.repeat([f"u{i}" for i in range(USERS)], SIZES)
    x = g.integers(0, 256, (n, 8, 8), dtype=np.uint8)
    y = np.arange(n) % 3
    keep = ids != drop
    arrays = dict(x_train=x[keep], y_train=y[keep], x_test=x[:6], y_test=y[:6])
    if with_ids:
        arrays["user_ids"] = ids[keep]
    np.savez(path, **arrays)
    return path


def first_release(tmp_path, name: str, data, *extra: str) -> dict[str, torch.Tensor]:
    """The first step's released gradient times B (the noisy clipped sum) of a seeded run."""
    released = []
    settings = [
        f"run.out_dir={tmp_path / name}",
        "run.seed=0",
        "model.name=linear",
        "data.name=npz",
        f"data.root={data}",
        "data.normalize=false",
        "dp.noise_multiplier=1.0",
        "dp.epsilon=null",
        "train.steps=2",
        "dp.delta=1e-3",
        "train.eval_every_epochs=100",
        "optim.lr=0.1",
        *extra,
    ]
    config = load_config(None, settings)
    trainer = Trainer.create(
        config, progress=False, hooks=RunHooks(observe_gradient=lambda g: released.append(g))
    )
    trainer.run(max_steps=1)
    batch = trainer.built.plan.batch_size
    return {k: v.double() * batch for k, v in released[0].items()}


def change(a, b) -> float:
    return float(sum((a[k] - b[k]).square().sum() for k in a).sqrt()) / C


USER = ["data.privacy_unit=user", "dp.max_examples_per_user=4"]


@pytest.mark.parametrize(
    "extra, bands",
    [
        ([], 1),
        (["dp.max_grad_norm={'head.0.weight': 0.6, '*': 0.8}"], 1),
        (["dp.mechanism=bandmf", "dp.bands=2"], 2),
        # AugMult's path (K views per image inside each user's rows) with views that draw nothing
        (["augment.multiplicity=2", "augment.type=identity"], 1),
        (["train.engine=bk"], 1),
        (["train.engine=ghost"], 1),
        (["train.engine=vmap"], 1),
        (["dp.clipping=automatic"], 1),
        (["dp.clipping=automatic", "train.engine=vmap"], 1),
        (["dp.clipping=automatic", "train.engine=ghost"], 1),
    ],
    ids=[
        "dpsgd",
        "per-layer",
        "bandmf",
        "augmult",
        "bk",
        "ghost",
        "vmap",
        "automatic",
        "automatic-vmap",
        "automatic-ghost",
    ],
)
def test_removing_one_users_images_moves_a_training_runs_release_by_at_most_c(
    tmp_path, extra, bands
):
    # q = 1 (BandMF: p = b q = 1): every user of the step's group is drawn
    def batch(users: int) -> str:
        return f"dp.batch_size={users / bands}"

    full = first_release(
        tmp_path, "full", write_npz(tmp_path / "full.npz"), *USER, *extra, batch(USERS)
    )
    probes = ["u2", "u4", "u5"]
    if bands > 1:  # the first step draws group 0
        ids = np.array([f"u{i}" for i in range(USERS)])
        group = dict(zip(ids, user_groups(ids, bands, run_seeds(0)["partition"])))
        probes = [u for u in probes if group[u] == 0]
        assert probes, "no probed user in the first step's group"
    for user in probes:
        data = write_npz(tmp_path / f"no-{user}.npz", drop=user)
        without = first_release(tmp_path, f"no-{user}", data, *USER, *extra, batch(USERS - 1))
        assert change(full, without) <= 1.0 + 1e-5


def test_at_the_example_unit_the_same_removal_moves_the_release_by_more_than_c(tmp_path):
    n = sum(SIZES)
    full = first_release(tmp_path, "full", write_npz(tmp_path / "full.npz"), f"dp.batch_size={n}")
    without = first_release(
        tmp_path, "no", write_npz(tmp_path / "no.npz", drop="u4"), f"dp.batch_size={n - 4}"
    )
    # 4 images, each clipped to C on its own (B differs: / B undone)
    assert change(full, without) > 1.2


def test_the_summary_and_header_name_the_unit(tmp_path, capsys):
    data = write_npz(tmp_path / "d.npz")
    settings = [
        f"run.out_dir={tmp_path / 'run'}",
        "run.seed=0",
        "model.name=linear",
        "data.name=npz",
        f"data.root={data}",
        "dp.batch_size=4",
        "dp.epsilon=3",
        "dp.delta=1e-3",
        "train.epochs=2",
        *USER,
    ]
    trainer = Trainer.create(load_config(None, settings), progress=False, report=True)
    trainer.run()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["privacy_unit"], summary["max_examples_per_user"], summary["dataset_size"]) == (
        "user",
        4,
        USERS,
    )
    assert (
        summary["protects"].startswith("any one person's")
        and "per user" in summary["privacy_status"]
    )
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert records and all(r["privacy_unit"] == "user" for r in records)
    assert trainer.built.plan.steps == 5  # 2 epochs over 10 users at 4 users per step
    err = capsys.readouterr().err
    assert "N=10 users" in err and "any one person's training images" in err
    from dpscale.cli import main

    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "m.safetensors")]) == 0
    card = (tmp_path / "m.safetensors.card.md").read_text()
    assert "N = 10 users, at most 4 images each per step" in card and "privacy unit: user" in card


def _idx(path, array: np.ndarray, kind: str) -> None:
    header = struct.pack(">HBB", 0, 8, array.ndim) + b"".join(
        struct.pack(">I", d) for d in array.shape
    )
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_an_idx_side_file_names_the_users_and_the_held_out_split_keeps_users_whole(tmp_path):
    from dpscale.data.datasets import load_idx

    g = np.random.default_rng(1)
    ids = np.repeat(np.arange(40), 3)
    _idx(tmp_path / "train-images-idx3-ubyte.gz", g.integers(0, 256, (120, 8, 8)), "images")
    _idx(tmp_path / "train-labels-idx1-ubyte.gz", np.arange(120) % 10, "labels")
    (tmp_path / "train-user-ids.txt").write_text("\n".join(f"person-{i}" for i in ids) + "\n")
    data = load_idx(tmp_path, "mnist")
    assert len(data.user_ids) == data.info.num_train == 120 - data.info.num_test
    # users of 3, none split
    assert data.info.num_test % 3 == 0 and "by whole users" in data.info.test_split
    assert all(np.sum(data.user_ids == u) == 3 for u in np.unique(data.user_ids))
    (tmp_path / "train-user-ids.txt").write_text("a\nb\n")
    with pytest.raises(Exception, match="holds \\(2,\\) ids but the training set has 120 examples"):
        load_idx(tmp_path, "mnist")


def test_the_user_unit_without_ids_or_with_a_feature_it_does_not_cover_is_refused(tmp_path):
    data = write_npz(tmp_path / "d.npz", with_ids=False)
    base = [
        f"run.out_dir={tmp_path / 'run'}",
        "model.name=linear",
        "data.name=npz",
        f"data.root={data}",
    ]
    with pytest.raises(ConfigError, match="needs a user id per training image") as refused:
        Trainer.create(load_config(None, base + USER), progress=False)
    assert "\n" not in str(refused.value)
    for setting, words in [
        (["data.privacy_unit=user"], "needs dp.max_examples_per_user"),
        (["dp.max_examples_per_user=2"], "needs data.privacy_unit=user"),
        (USER + ["dp.sampling=shuffle"], "samples users by Poisson sampling"),
        (["data.privacy_unit=person"], "data.privacy_unit must be"),
    ]:
        with pytest.raises(ConfigError, match=words):
            load_config(None, base + setting)


def test_audit_and_private_tuning_refuse_the_user_unit_in_one_line(tmp_path, capsys):
    from dpscale.audit.run import audit_config_problems

    config = load_config(None, ["data.name=npz", "data.root=x.npz", *USER])
    assert any("data.privacy_unit=user" in p for p in audit_config_problems(config))
    from dpscale.cli import main

    data = write_npz(tmp_path / "d.npz")
    code = main(
        [
            "sweep",
            "--set",
            "data.name=npz",
            "--set",
            f"data.root={data}",
            "--set",
            "data.privacy_unit=user",
            "--set",
            "dp.max_examples_per_user=4",
            "--set",
            "model.name=linear",
            "--grid",
            "optim.lr=0.1,0.2",
            "--private-tuning",
            "poisson:1",
            "--out",
            str(tmp_path / "sweep"),
            "--quiet",
        ]
    )
    assert (
        code == 2
        and "--private-tuning does not follow data.privacy_unit=user" in capsys.readouterr().err
    )


def _folder(tmp_path, users_csv: str | None):
    from PIL import Image

    g = np.random.default_rng(2)
    for c in ("cat", "dog"):
        (tmp_path / "imgs" / c).mkdir(parents=True, exist_ok=True)
        for i in range(12):
            Image.fromarray(g.integers(0, 256, (8, 8), dtype=np.uint8)).save(
                tmp_path / "imgs" / c / f"{i}.png"
            )
    if users_csv is not None:
        (tmp_path / "imgs" / "users.csv").write_text(users_csv)
    return tmp_path / "imgs"


def test_an_image_folders_users_csv_names_the_users_in_memory_and_through_auto(tmp_path):
    from dpscale.data.datasets import load_image_folder
    from dpscale.data.stream import materialize, open_stream

    rows = ["path,label,user"] + [
        f"{c}/{i}.png,{c},p{i // 3}-{c}" for c in ("cat", "dog") for i in range(12)
    ]
    root = _folder(tmp_path, "\n".join(rows) + "\n")
    data = load_image_folder(root)
    assert len(data.user_ids) == data.info.num_train and "by whole users" in data.info.test_split
    assert data.info.num_test % 3 == 0  # users of 3 images, none split
    streamed = materialize(open_stream("imagefolder", root))
    assert streamed.user_ids.tolist() == data.user_ids.tolist()
    settings = [
        f"run.out_dir={tmp_path / 'run'}",
        "run.seed=0",
        "model.name=linear",
        "data.name=imagefolder",
        f"data.root={root}",
        "dp.batch_size=2",
        "dp.noise_multiplier=1",
        "dp.epsilon=null",
        "train.steps=2",
        *USER,
    ]
    trainer = Trainer.create(load_config(None, settings), progress=False)
    trainer.run()
    assert trainer.built.plan.dataset_size == len(set(data.user_ids.tolist()))


@pytest.mark.parametrize(
    "rows, words",
    [
        (["path,who"], "found columns .path., .who.; expected a path column"),
        (["path,user", "cat/0.png,a"], "names no user for 23 training image"),
        (
            ["path,label,user", "cat/0.png,dog,a"],
            "label 'dog' but cat/0.png is in class folder 'cat'",
        ),
    ],
)
def test_a_bad_users_csv_is_refused_in_one_line(tmp_path, rows, words):
    from dpscale.data.datasets import load_image_folder
    from dpscale.data.formats import DatasetError

    with pytest.raises(DatasetError, match=words) as refused:
        load_image_folder(_folder(tmp_path, "\n".join(rows) + "\n"))
    assert "\n" not in str(refused.value)


def test_data_normalization_and_centring_run_per_user_and_are_composed(tmp_path):
    data = write_npz(tmp_path / "d.npz")
    settings = [
        f"run.out_dir={tmp_path / 'run'}",
        "run.seed=0",
        "model.name=linear",
        "data.name=npz",
        f"data.root={data}",
        "dp.batch_size=4",
        "dp.epsilon=3",
        "dp.delta=1e-3",
        "train.steps=2",
        "features.normalize=datanorm",
        "features.center=true",
        *USER,
    ]
    trainer = Trainer.create(load_config(None, settings), progress=False)
    trainer.run()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["epsilon"] == pytest.approx(3.0, abs=0.01) and set(summary["epsilon_parts"]) >= {
        "data-norm",
        "feature-mean",
    }
    assert summary["privacy_unit"] == "user"


def test_a_user_level_run_resumes_bit_identically_with_augmult(tmp_path):
    from dpscale._io import load_checkpoint

    data = write_npz(tmp_path / "d.npz")

    def settings(name: str) -> list[str]:
        return [
            f"run.out_dir={tmp_path / name}",
            "run.seed=0",
            "model.name=linear",
            "data.name=npz",
            f"data.root={data}",
            "dp.batch_size=3",
            "dp.noise_multiplier=1",
            "dp.epsilon=null",
            "train.steps=6",
            "augment.multiplicity=2",
            "augment.type=crop-flip",
            "train.eval_every_epochs=100",
            *USER,
        ]

    Trainer.create(load_config(None, settings("full")), progress=False).run()
    Trainer.create(load_config(None, settings("cut")), progress=False).run(max_steps=3)
    Trainer.resume(tmp_path / "cut", progress=False).run()
    a, b = (
        load_checkpoint(tmp_path / "full" / "checkpoint.pt"),
        load_checkpoint(tmp_path / "cut" / "checkpoint.pt"),
    )
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    with pytest.raises(ConfigError, match="privacy unit user"):
        Trainer.resume(
            tmp_path / "cut",
            progress=False,
            overrides=["data.privacy_unit=example", "dp.max_examples_per_user=null"],
        )


def test_dpscale_data_prepare_stores_the_users_and_shards_give_them_back(tmp_path):
    from dpscale.cli import main
    from dpscale.data.datasets import load_image_folder, load_shards
    from dpscale.data.stream import materialize, open_stream

    rows = ["path,user"] + [f"{c}/{i}.png,p{i // 4}" for c in ("cat", "dog") for i in range(12)]
    root = _folder(tmp_path, "\n".join(rows) + "\n")
    assert main(["data", "prepare", str(root), str(tmp_path / "shards"), "--size", "8"]) == 0
    want = load_image_folder(root).user_ids.tolist()
    assert load_shards(tmp_path / "shards").user_ids.tolist() == want
    assert materialize(open_stream("shards", tmp_path / "shards")).user_ids.tolist() == want
    settings = [
        f"run.out_dir={tmp_path / 'run'}",
        "run.seed=0",
        "model.name=linear",
        "data.name=shards",
        f"data.root={tmp_path / 'shards'}",
        "dp.batch_size=2",
        "dp.noise_multiplier=1",
        "dp.epsilon=null",
        "train.steps=2",
        *USER,
    ]
    trainer = Trainer.create(load_config(None, settings), progress=False)
    trainer.run()
    assert trainer.built.plan.dataset_size == len(set(want)) == 2  # of 3 people: one held out whole


def test_a_streamed_user_level_run_is_the_in_memory_run(tmp_path):
    """data.loader=stream reads whole users' chunks from disk: the same steps, bit for bit."""
    from dpscale._io import load_checkpoint

    rows = ["path,user"] + [
        f"{c}/{i}.png,p{(i * 7) % 5}" for c in ("cat", "dog") for i in range(12)
    ]
    root = _folder(tmp_path, "\n".join(rows) + "\n")

    def run(loader: str):
        settings = [
            f"run.out_dir={tmp_path / loader}",
            "run.seed=0",
            "model.name=linear",
            "data.name=imagefolder",
            f"data.root={root}",
            f"data.loader={loader}",
            "data.workers=0",
            "dp.batch_size=2",
            "dp.noise_multiplier=1",
            "dp.epsilon=null",
            "train.steps=3",
            "train.max_physical_batch_size=8",
            "augment.multiplicity=2",
            "augment.type=crop-flip",
            *USER,
        ]
        Trainer.create(load_config(None, settings), progress=False).run()
        assert json.loads((tmp_path / loader / "summary.json").read_text())["data_loader"] == loader
        return load_checkpoint(tmp_path / loader / "checkpoint.pt")["model"]

    memory, stream = run("memory"), run("stream")
    for name, tensor in memory.items():
        assert torch.equal(tensor, stream[name]), name


def test_source_runs_across_units_are_refused_not_composed(tmp_path):
    """A user-level run's history is no per-image event (removing one of a person's images can move
    it by 2C), and an example-level seed run protects a person only by group privacy: neither is
    composed into the other unit's epsilon (review findings, issue 43)."""
    data = write_npz(tmp_path / "d.npz")
    base = [
        "model.name=linear",
        "data.name=npz",
        f"data.root={data}",
        "run.seed=0",
        "dp.epsilon=null",
        "dp.noise_multiplier=1.0",
        "dp.delta=1e-3",
        "train.eval_every_epochs=100",
    ]
    for unit, extra in (("user", USER + ["dp.batch_size=4"]), ("example", ["dp.batch_size=4"])):
        Trainer.create(
            load_config(None, [*base, f"run.out_dir={tmp_path / unit}", "train.steps=2", *extra]),
            progress=False,
        ).run()
    cases = [  # (this run's settings, the source, the words of the refusal)
        (["dp.batch_size=2"], [f"model.init={tmp_path / 'user'}"], "accounted per person"),
        (
            ["dp.batch_size=2"],
            ["model.init_scaling=meanvar", f"model.init_seed_model={tmp_path / 'user'}"],
            "accounted per person",
        ),
        (
            USER + ["dp.batch_size=2"],
            ["model.init_scaling=meanvar", f"model.init_seed_model={tmp_path / 'example'}"],
            "cannot compose a source run on the same data",
        ),
        (
            USER + ["dp.batch_size=2"],
            [f"model.init={tmp_path / 'example'}"],
            "cannot compose a source run",
        ),
    ]
    for i, (unit, source, words) in enumerate(cases):
        with pytest.raises(ConfigError, match=words):
            Trainer.create(
                load_config(
                    None,
                    [*base, f"run.out_dir={tmp_path / f'r{i}'}", "train.steps=1", *unit, *source],
                ),
                progress=False,
            )


def test_resuming_after_the_user_ids_changed_is_refused(tmp_path):
    data = write_npz(tmp_path / "d.npz")
    settings = [
        f"run.out_dir={tmp_path / 'run'}",
        "run.seed=0",
        "model.name=linear",
        "data.name=npz",
        f"data.root={data}",
        "dp.batch_size=3",
        "dp.noise_multiplier=1",
        "dp.epsilon=null",
        "train.steps=4",
        *USER,
    ]
    Trainer.create(load_config(None, settings), progress=False).run(max_steps=2)
    arrays = dict(np.load(data))
    # the same images and people count, regrouped
    arrays["user_ids"] = np.roll(arrays["user_ids"], 1)
    np.savez(data, **arrays)
    with pytest.raises(Exception, match="another grouping of the examples into users"):
        Trainer.resume(tmp_path / "run", progress=False).run()


def test_users_csv_changes_no_pixel_of_8_and_16_bit_png_jpeg_and_rgba_images(tmp_path):
    """The manifest only names users (and the split): every training image's pixels are those the
    folder loader gives without it, for each kind of file it reads, in memory and streamed."""
    from PIL import Image

    from dpscale.data.datasets import load_image_folder
    from dpscale.data.folder import list_image_folder
    from dpscale.data.stream import materialize, open_stream

    g = np.random.default_rng(3)
    root = tmp_path / "imgs"
    kinds = {
        "png8": ("L", np.uint8, "png"),
        "png16": ("I;16", np.uint16, "png"),
        "jpeg": ("RGB", np.uint8, "jpg"),
        "rgba": ("RGBA", np.uint8, "png"),
    }
    rows = ["path,user"]
    for c in ("cat", "dog"):
        (root / c).mkdir(parents=True)
        for i, (kind, (mode, dtype, ext)) in enumerate(list(kinds.items()) * 2):
            shape = (8, 8, 4) if mode == "RGBA" else (8, 8, 3) if mode == "RGB" else (8, 8)
            pixels = g.integers(0, np.iinfo(dtype).max, shape, dtype=dtype, endpoint=True)
            Image.fromarray(pixels, mode if mode != "I;16" else None).save(
                root / c / f"{kind}{i}.{ext}"
            )
            rows.append(f"{c}/{kind}{i}.{ext},p{i % 4}")
    plain_listing = list_image_folder(root)
    plain = dict(zip(plain_listing.train_files, load_image_folder(root).x_train))
    (root / "users.csv").write_text("\n".join(rows) + "\n")
    listing = list_image_folder(root)
    assert listing.train_users is not None
    for data in (load_image_folder(root), materialize(open_stream("imagefolder", root))):
        common = [(f, x) for f, x in zip(listing.train_files, data.x_train) if f in plain]
        assert common
        for path, x in common:
            assert torch.equal(x, plain[path]), path

"""Feature extractors (ScatterNet, registry models, trained runs) and the feature cache."""

import json
import shutil
from dataclasses import replace

import pytest
import torch

from dpscale.config import load_config
from dpscale.data import DatasetInfo, ImageDataset
from dpscale.features import (
    FeatureExtractor,
    ScatterNet,
    default_cache_dir,
    extract_features,
    feature_cache_key,
    load_or_extract,
    make_extractor,
    scatter_output_shape,
)
from dpscale.models import build_model


def tiny_dataset(shape=(1, 28, 28), n_train=24, n_test=8, seed=0) -> ImageDataset:
    gen = torch.Generator().manual_seed(seed)
    info = DatasetInfo("tiny", n_train, n_test, 10, shape, "test", "official")
    return ImageDataset(
        torch.rand((n_train, *shape), generator=gen),
        torch.randint(0, 10, (n_train,), generator=gen),
        torch.rand((n_test, *shape), generator=gen),
        torch.randint(0, 10, (n_test,), generator=gen),
        info,
    )


def count_calls(extractor: FeatureExtractor) -> list[int]:
    """A counter of the extractor's forward passes."""
    calls = [0]
    extractor.module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These tensors are tiny: a thread pool only adds synchronisation, and when the CPU is busy
    (e.g. another test run) each of ScatterNet's ~1500 small ops waits for a descheduled worker,
    which made this file ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def kymatio():
    return pytest.importorskip("kymatio")


# ------------------------------------------------------------------ ScatterNet
@pytest.mark.parametrize("shape, expected", [((1, 28, 28), (81, 7, 7)), ((3, 32, 32), (243, 8, 8))])
def test_scatternet_output_shape_matches_the_paper_and_the_formula(kymatio, shape, expected):
    net = ScatterNet(shape)
    out = net(torch.rand(2, *shape))
    assert tuple(out.shape) == (2, *expected)
    assert scatter_output_shape(shape) == expected == net.output_shape


@pytest.mark.parametrize("J, L, max_order", [(1, 8, 2), (2, 4, 1), (3, 8, 2)])
def test_scatter_output_shape_formula_agrees_with_kymatio(kymatio, J, L, max_order):
    shape = (2, 16, 24)
    out = ScatterNet(shape, J=J, L=L, max_order=max_order)(torch.rand(1, *shape))
    assert tuple(out.shape[1:]) == scatter_output_shape(shape, J=J, L=L, max_order=max_order)


def test_scatternet_pad_is_the_transform_of_the_zero_padded_image(kymatio):
    # Reference: an unpadded ScatterNet built for the larger image, fed the image padded by hand.
    x = torch.rand(3, 1, 28, 28)
    padded = ScatterNet((1, 28, 28), pad=2)
    assert padded.output_shape == (81, 8, 8) == scatter_output_shape((1, 28, 28), pad=2)
    by_hand = torch.zeros(3, 1, 32, 32)
    by_hand[:, :, 2:30, 2:30] = x
    torch.testing.assert_close(padded(x), ScatterNet((1, 32, 32))(by_hand), rtol=0, atol=0)
    assert padded(x).shape == (3, 81, 8, 8)
    with pytest.raises(ValueError, match="pad must be >= 0"):
        scatter_output_shape((1, 28, 28), pad=-1)
    with pytest.raises(ValueError, match="scatter_pad"):
        # 30 is not divisible by 4: the hint names the option
        scatter_output_shape((1, 28, 28), pad=1)


def test_padded_scatternet_features_are_cached_apart(kymatio):
    plain, padded = (
        make_extractor("scatternet", (1, 28, 28)),
        make_extractor("scatternet", (1, 28, 28), pad=2),
    )
    assert "pad" not in plain.spec and padded.spec["pad"] == 2  # unpadded cache keys unchanged
    assert (
        padded.output_shape == (81, 8, 8)
        and padded.name == "scatternet(J=2, L=8, max_order=2, pad=2)"
    )


def test_scatternet_flattens_channel_major(kymatio):
    # Channel c of the input owns output channels c*K .. (c+1)*K - 1.
    x = torch.rand(2, 3, 16, 16)
    gray = ScatterNet((1, 16, 16))
    rgb = ScatterNet((3, 16, 16))(x)
    for c in range(3):
        torch.testing.assert_close(
            rgb[:, c * 81 : (c + 1) * 81], gray(x[:, c : c + 1].contiguous())
        )


@pytest.mark.parametrize(
    "shape, kwargs, match",
    [
        ((1, 30, 28), {}, "divisible"),
        ((1, 28, 2), {}, "at least 4"),
        ((1, 28, 28), {"J": 0}, "J"),
        ((1, 28, 28), {"max_order": 3}, "max_order"),
        ((28, 28), {}, r"\(C, H, W\)"),
    ],
)
def test_scatter_output_shape_rejects_bad_sizes(shape, kwargs, match):
    with pytest.raises(ValueError, match=match):
        scatter_output_shape(shape, **kwargs)


def test_scatternet_is_fixed_and_deterministic(kymatio):
    net = ScatterNet((1, 28, 28))
    assert list(net.parameters()) == []
    x = torch.rand(4, 1, 28, 28)
    assert torch.equal(net(x), net(x))
    assert torch.equal(net(x), ScatterNet((1, 28, 28))(x))
    with pytest.raises(ValueError, match="shape"):
        net(torch.rand(4, 3, 28, 28))  # kymatio itself would treat the channels as batch


# ------------------------------------------------------------------ extractors
def test_extract_features_batched_equals_one_pass(kymatio):
    extractor = make_extractor("scatternet", (1, 28, 28))
    x = torch.rand(37, 1, 28, 28)
    out = extract_features(extractor, x, batch_size=8, progress=False)
    assert out.dtype == torch.float32 and out.device.type == "cpu" and out.shape == (37, 81, 7, 7)
    torch.testing.assert_close(out, extractor.module(x), rtol=1e-5, atol=1e-6)
    assert extract_features(extractor, x[:0], progress=False).shape == (0, 81, 7, 7)
    with pytest.raises(ValueError, match="shape"):
        extract_features(extractor, torch.rand(2, 1, 32, 32), progress=False)


def test_model_extractor_is_forward_features_of_a_seeded_model():
    state = torch.get_rng_state()
    extractor = make_extractor("model:papernot-cnn", (1, 28, 28))
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is left alone
    torch.manual_seed(0)
    model = build_model("papernot-cnn", num_classes=10, input_shape=(1, 28, 28)).eval()
    x = torch.rand(5, 1, 28, 28)
    expected = model.forward_features(x)
    assert extractor.output_shape == tuple(expected.shape[1:])
    torch.testing.assert_close(
        extract_features(extractor, x, batch_size=2, progress=False), expected
    )
    assert not any(p.requires_grad for p in extractor.module.parameters())
    json.dumps(extractor.spec)
    again = make_extractor("model:papernot-cnn", (1, 28, 28))
    assert again.spec == extractor.spec and len(extractor.spec["weights_sha256"]) == 64


def test_unknown_or_unfit_extractor_specs_are_rejected():
    with pytest.raises(ValueError, match="valid forms"):
        make_extractor("pixels", (1, 28, 28))
    with pytest.raises(ValueError, match="valid forms"):
        make_extractor("model:", (1, 28, 28))
    with pytest.raises(ValueError, match="unknown model"):
        make_extractor("model:no-such-net", (1, 28, 28))
    with pytest.raises(ValueError, match="too small"):
        make_extractor("model:papernot-cnn", (1, 8, 8))
    with pytest.raises(ValueError, match=r"\(C, H, W\)"):
        make_extractor("scatternet", (28, 28))


# ----------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A 2-step private run on the embedded MNIST sample."""
    from dpscale.train.loop import Trainer

    run_dir = tmp_path_factory.mktemp("features") / "run"
    config = load_config(
        None,
        [
            f"run.out_dir={run_dir}",
            "run.seed=0",
            "dp.epsilon=null",
            "dp.noise_multiplier=1.0",
            "dp.batch_size=32",
            "train.steps=2",
        ],
    )
    trainer = Trainer.create(config, progress=False)
    trainer.run()
    return run_dir, trainer.model.eval(), trainer.data.x_test[:16].cpu()


def test_checkpoint_extractor_reproduces_the_trained_features(trained_run):
    run_dir, model, x = trained_run
    expected = model.forward_features(x)
    for where in (run_dir, run_dir / "checkpoint.pt"):
        extractor = make_extractor(f"checkpoint:{where}", (1, 28, 28))
        assert extractor.spec["kind"] == "checkpoint" and extractor.spec["num_classes"] == 10
        torch.testing.assert_close(
            extract_features(extractor, x, batch_size=5, progress=False), expected
        )
    # Different weights from the same architecture: a different spec, hence a different cache key.
    assert (
        extractor.spec["weights_sha256"]
        != make_extractor("model:papernot-cnn", (1, 28, 28)).spec["weights_sha256"]
    )


def test_checkpoint_extractor_rejects_other_image_shapes_and_non_runs(trained_run, tmp_path):
    run_dir, _, _ = trained_run
    with pytest.raises(ValueError, match="1x28x28"):
        make_extractor(f"checkpoint:{run_dir}", (3, 32, 32))
    with pytest.raises(ValueError, match="not a dpscale run directory"):
        make_extractor(f"checkpoint:{tmp_path}", (1, 28, 28))
    # When the config does not pin the image shape (npz data), the weights themselves do.
    copy = tmp_path / "npz-run"
    shutil.copytree(run_dir, copy)
    text = (copy / "config.yaml").read_text()
    (copy / "config.yaml").write_text(text.replace("name: mnist-5k", "name: npz", 1))
    assert make_extractor(f"checkpoint:{copy}", (1, 28, 28)).output_shape == (512,)
    for shape in ((3, 28, 28), (1, 32, 32)):
        with pytest.raises(ValueError, match="images of another shape"):
            make_extractor(f"checkpoint:{copy}", shape)
    (copy / "checkpoint.pt").unlink()
    with pytest.raises(ValueError, match="no checkpoint"):
        make_extractor(f"checkpoint:{copy}", (1, 28, 28))


def test_checkpoint_of_a_run_trained_on_features_is_rejected(trained_run, tmp_path):
    run_dir, _, _ = trained_run
    text = (run_dir / "config.yaml").read_text()
    if "extractor: null" not in text:
        pytest.skip("this config has no features section")
    copy = tmp_path / "features-run"
    shutil.copytree(run_dir, copy)
    (copy / "config.yaml").write_text(text.replace("extractor: null", "extractor: scatternet", 1))
    with pytest.raises(ValueError, match="trained on scatternet features"):
        make_extractor(f"checkpoint:{copy}", (1, 28, 28))


# ------------------------------------------------------------------- the cache
def test_cache_miss_then_hit_without_recomputing(kymatio, tmp_path):
    data = tiny_dataset()
    extractor = make_extractor("scatternet", (1, 28, 28))
    calls = count_calls(extractor)
    messages: list[str] = []
    first, hit = load_or_extract(
        extractor, data, tmp_path, batch_size=10, progress=False, log=messages.append
    )
    assert not hit and calls[0] == 3 + 1  # 24 train images in batches of 10, 8 test images
    assert "saved to" in messages[-1] and "24+8" in messages[-1]
    assert first.x_train.shape == (24, 81, 7, 7) and first.x_test.shape == (8, 81, 7, 7)
    assert first.info.input_shape == (81, 7, 7) and first.info.num_train == 24
    assert first.y_train is data.y_train and first.y_test is data.y_test
    assert [p.name for p in tmp_path.iterdir()] == [f"{feature_cache_key(extractor, data)}.pt"]

    second, hit = load_or_extract(extractor, data, tmp_path, progress=False, log=messages.append)
    assert hit and calls[0] == 4
    assert messages[-1].startswith("features: loaded from cache")
    assert torch.equal(second.x_train, first.x_train) and torch.equal(second.x_test, first.x_test)
    assert second.info == first.info


def test_cache_key_changes_with_the_data_and_the_extractor(kymatio, tmp_path):
    data = tiny_dataset()
    j2 = make_extractor("scatternet", (1, 28, 28))
    key = feature_cache_key(j2, data)
    assert feature_cache_key(make_extractor("scatternet", (1, 28, 28)), tiny_dataset()) == key
    changed_train = replace(
        data, x_train=data.x_train.clone().index_fill_(0, torch.tensor([3]), 0.5)
    )
    changed_test = replace(data, x_test=1 - data.x_test)
    relabelled = replace(data, y_test=(data.y_test + 1) % 10)
    one_pixel = data.x_train.clone()
    one_pixel[5, 0, 13, 17] += 1e-3  # a cache hit must mean the very same images, to the last pixel
    changed_pixel = replace(data, x_train=one_pixel)
    j1 = make_extractor("scatternet", (1, 28, 28), J=1)
    other_model = make_extractor("model:papernot-cnn", (1, 28, 28))
    keys = {
        key,
        feature_cache_key(j2, changed_train),
        feature_cache_key(j2, changed_test),
        feature_cache_key(j2, relabelled),
        feature_cache_key(j2, changed_pixel),
        feature_cache_key(j1, data),
        feature_cache_key(other_model, data),
    }
    assert len(keys) == 7

    load_or_extract(j2, data, tmp_path, progress=False)
    for extractor, dataset in ((j2, changed_train), (j1, data)):
        _, hit = load_or_extract(extractor, dataset, tmp_path, progress=False)
        assert not hit
    assert len(list(tmp_path.iterdir())) == 3


@pytest.mark.parametrize("damage", ["garbage", "truncated", "wrong-shape"])
def test_damaged_cache_file_is_reported_recomputed_and_overwritten(kymatio, tmp_path, damage):
    data = tiny_dataset()
    extractor = make_extractor("scatternet", (1, 28, 28))
    good, _ = load_or_extract(extractor, data, tmp_path, progress=False)
    path = tmp_path / f"{feature_cache_key(extractor, data)}.pt"
    if damage == "garbage":
        path.write_bytes(b"not a torch file")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
    else:
        state = torch.load(path, weights_only=True)
        state["x_train"] = state["x_train"][:5]
        torch.save(state, path)
    messages: list[str] = []
    again, hit = load_or_extract(extractor, data, tmp_path, progress=False, log=messages.append)
    assert not hit and torch.equal(again.x_train, good.x_train)
    assert "ignoring cache file" in messages[0] and "saved to" in messages[-1]
    _, hit = load_or_extract(extractor, data, tmp_path, progress=False)
    assert hit  # the file was rewritten


def test_cache_for_model_features_and_opting_out(tmp_path):
    data = tiny_dataset()
    extractor = make_extractor("model:papernot-cnn", (1, 28, 28))
    features, hit = load_or_extract(extractor, data, tmp_path, progress=False)
    assert not hit and features.info.input_shape == (512,) and features.x_train.shape == (24, 512)
    assert load_or_extract(extractor, data, tmp_path, progress=False)[1]
    calls = count_calls(extractor)
    _, hit = load_or_extract(extractor, data, tmp_path / "unused", progress=False, use_cache=False)
    assert not hit and calls[0] == 2 and not (tmp_path / "unused").exists()


def test_unwritable_cache_is_reported_not_raised(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    messages: list[str] = []
    features, hit = load_or_extract(
        make_extractor("model:linear", (1, 28, 28)),
        tiny_dataset(),
        blocker,
        progress=False,
        log=messages.append,
    )
    assert not hit and features.x_train.shape == (24, 784) and "could not save" in messages[-1]


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("DPSCALE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "dpscale" / "features"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "dpscale" / "features"
    monkeypatch.setenv("DPSCALE_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"

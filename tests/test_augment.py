"""Per-view augmentations (dpscale.data.augment): shapes, per-example randomness, exactness against
naive per-view references, reproducibility across a resume, and AugTest's majority vote."""

import math
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dpscale.data import augment
from dpscale.data.augment import AUGMENTATIONS, augment_views, majority_vote


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Other test runs may share the machine's cores; one thread keeps this file fast and fair."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def images(n, c, size, seed=0, value_range=(-1.0, 1.0)):
    """Random images uniform in value_range (distinct pixels, so equal views mean equal params)."""
    low, high = value_range
    return low + (high - low) * torch.rand(
        n, c, size, size, generator=torch.Generator().manual_seed(seed)
    )


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- contract


@pytest.mark.parametrize("kind", AUGMENTATIONS)
@pytest.mark.parametrize("c, size", [(1, 28), (3, 32)])
def test_shape_dtype_and_device(kind, c, size):
    x = images(5, c, size)
    out = augment_views(x, kind, 3, gen())
    assert out.shape == (5, 3, c, size, size)
    assert out.dtype == x.dtype and out.device == x.device
    double = augment_views(x.double(), kind, 2, gen())
    assert double.dtype == torch.float64 and double.shape == (5, 2, c, size, size)


def test_empty_batch_and_k_equal_one():
    assert augment_views(images(0, 3, 8), "simclr", 4, gen()).shape == (0, 4, 3, 8, 8)
    assert augment_views(images(2, 3, 8), "crop-flip", 1, gen()).shape == (2, 1, 3, 8, 8)


def test_identity_gives_exact_copies():
    x = images(4, 3, 32)
    out = augment_views(x, "identity", 5, gen())
    assert torch.equal(out, x.unsqueeze(1).expand_as(out))
    out[0, 0] = 7.0  # the views are copies, not views of x
    assert not (x == 7.0).any()


def test_bad_arguments():
    x = images(1, 1, 8)
    with pytest.raises(
        ValueError, match="unknown augmentation.*identity, crop-flip, crop, rrc, simclr"
    ):
        augment_views(x, "mixup", 2, gen())
    with pytest.raises(ValueError, match=">= 1"):
        augment_views(x, "identity", 0, gen())
    with pytest.raises(ValueError, match=r"\(N, C, H, W\)"):
        augment_views(torch.zeros(3, 8, 8), "identity", 2, gen())
    with pytest.raises(ValueError, match="padding"):
        augment_views(x, "crop-flip", 2, gen(), padding=8)
    with pytest.raises(ValueError, match="value_range"):
        augment_views(x, "simclr", 2, gen(), value_range=(1.0, 1.0))


# --------------------------------------------------------------------------- randomness


@pytest.mark.parametrize(
    "kind, min_distinct", [("crop-flip", 10), ("crop", 10), ("rrc", 60), ("simclr", 60)]
)
def test_parameters_are_drawn_per_view(kind, min_distinct):
    """16 identical images x 4 views: one draw per batch (torchvision) would give 1 distinct view."""
    x = images(1, 3, 32).expand(16, 3, 32, 32)
    views = augment_views(x, kind, 4, gen()).reshape(64, -1)
    assert torch.unique(views, dim=0).shape[0] >= min_distinct
    assert not torch.equal(augment_views(x, kind, 4, gen(0)), augment_views(x, kind, 4, gen(1)))


@pytest.mark.parametrize("kind", AUGMENTATIONS)
def test_same_seed_same_views_and_resume_from_saved_state(kind):
    x = images(6, 3, 16)
    g = gen(3)
    first = augment_views(x, kind, 2, g)
    saved = g.get_state()
    second = augment_views(x, kind, 2, g)
    assert torch.equal(first, augment_views(x, kind, 2, gen(3)))

    resumed = torch.Generator()
    resumed.set_state(saved)
    assert torch.equal(augment_views(x, kind, 2, resumed), second)
    assert torch.equal(resumed.get_state(), g.get_state())


@pytest.mark.parametrize("kind", AUGMENTATIONS)
def test_generator_advance_does_not_depend_on_the_pixels(kind):
    a, b = gen(9), gen(9)
    augment_views(images(6, 3, 16, seed=0), kind, 3, a)
    augment_views(torch.zeros(6, 3, 16, 16), kind, 3, b)
    assert torch.equal(a.get_state(), b.get_state())
    # ... nor on the value range or padding: only on (N, K, kind).
    c = gen(9)
    augment_views(
        images(6, 3, 16, value_range=(0, 1)), kind, 3, c, value_range=(0.0, 1.0), padding=2
    )
    assert torch.equal(a.get_state(), c.get_state())


# --------------------------------------------------------------------------- crop-flip


def naive_crop_flip(x, top, left, flip, padding):
    """One view at a time, with numpy's reflect padding as an independent reference."""
    n, c, h, w = x.shape
    padded = np.pad(
        x.numpy(), ((0, 0), (0, 0), (padding, padding), (padding, padding)), mode="reflect"
    )
    out = torch.empty(n, top.shape[1], c, h, w)
    for i in range(n):
        for k in range(top.shape[1]):
            t, lft = int(top[i, k]), int(left[i, k])
            window = torch.from_numpy(padded[i, :, t : t + h, lft : lft + w].copy())
            out[i, k] = window.flip(-1) if flip[i, k] else window
    return out


def test_crop_flip_equals_a_naive_per_view_loop():
    x = images(3, 2, 12)
    padding = 3
    g = gen(5)
    top, left, flip = augment._crop_flip_params(
        torch.rand(3, 4, 3, generator=g, dtype=torch.float64), padding
    )
    expected = naive_crop_flip(x, top, left, flip, padding)
    assert torch.equal(augment._crop_flip(x, top, left, flip, padding), expected)


def test_crop_flip_views_are_exact_windows_of_the_padded_image():
    """Through the public API: every view is, bit for bit, some (maybe mirrored) window."""
    x, padding = images(4, 3, 10), 2
    out = augment_views(x, "crop-flip", 8, gen(7), padding=padding)
    padded = F.pad(x, (padding,) * 4, mode="reflect")
    windows = padded.unfold(2, 10, 1).unfold(3, 10, 1)  # [N, C, 5, 5, 10, 10]
    windows = windows.permute(0, 2, 3, 1, 4, 5).reshape(4, 25, 3, 10, 10)
    candidates = torch.cat([windows, windows.flip(-1)], 1)  # [N, 50, C, H, W]
    match = (out.unsqueeze(2) == candidates.unsqueeze(1)).flatten(3).all(-1)  # [N, K, 50]
    assert match.any(-1).all()


def test_crop_flip_parameters_cover_every_offset_and_flip_half_the_time():
    u = torch.rand(4000, 1, 3, generator=gen(0), dtype=torch.float64)
    top, left, flip = augment._crop_flip_params(u, 4)
    assert set(top.unique().tolist()) == set(range(9)) == set(left.unique().tolist())
    assert 0.45 < flip.double().mean() < 0.55
    edge = torch.tensor([[[0.0, 1 - 2**-53, 0.0]]], dtype=torch.float64)  # largest uniform below 1
    assert augment._crop_flip_params(edge, 4)[1].item() == 8


def test_crop_views_are_unmirrored_windows_at_every_offset():
    """``crop`` (issue 47): translations only. Every view is, bit for bit, one window of the
    reflect-padded image, none a mirrored one (random pixels: no window equals a mirror image), and
    across many views every offset in [0, 2 * padding]^2 occurs."""
    x, padding = images(2, 1, 10), 2
    out = augment_views(x, "crop", 200, gen(11), padding=padding)
    padded = F.pad(x, (padding,) * 4, mode="reflect")
    windows = (
        padded.unfold(2, 10, 1).unfold(3, 10, 1).permute(0, 2, 3, 1, 4, 5).reshape(2, 25, 1, 10, 10)
    )
    match = (out.unsqueeze(2) == windows.unsqueeze(1)).flatten(3).all(-1)  # [N, K, 25]
    mirrored = (out.unsqueeze(2) == windows.flip(-1).unsqueeze(1)).flatten(3).all(-1)
    assert match.any(-1).all() and not mirrored.any()
    assert match.any(1).all()  # each of the 25 offsets drawn for each image
    top, left, flip = augment._crop_flip_params(
        torch.rand(50, 3, 2, generator=gen(1), dtype=torch.float64), padding
    )
    assert not flip.any() and top.shape == flip.shape == (50, 3)


# --------------------------------------------------------------------------- random resized crop


def full_boxes(n, k, size):
    zeros = torch.zeros(n, k, dtype=torch.int64)
    return zeros, zeros, zeros + size, zeros + size


def test_full_box_resized_crop_is_identity_or_flip():
    x = images(3, 3, 16)
    flip = torch.tensor([[False, True]] * 3)
    out = augment._resized_crop(x, *full_boxes(3, 2, 16), flip)
    torch.testing.assert_close(out[:, 0], x, atol=1e-5, rtol=0)
    torch.testing.assert_close(out[:, 1], x.flip(-1), atol=1e-5, rtol=0)


def test_area_one_aspect_one_boxes_are_the_whole_image():
    u = torch.rand(5, 3, augment._RRC_COLUMNS, generator=gen(0), dtype=torch.float64)
    top, left, box_h, box_w = augment._rrc_boxes(u, 28, 28, scale=(1.0, 1.0), ratio=(1.0, 1.0))
    assert (top == 0).all() and (left == 0).all() and (box_h == 28).all() and (box_w == 28).all()


def test_resized_crop_equals_crop_then_interpolate_per_view():
    """Per-view reference: torchvision's resized_crop is a crop followed by a bilinear resize."""
    x = images(2, 3, 16)
    u = torch.rand(2, 6, augment._RRC_COLUMNS, generator=gen(2), dtype=torch.float64)
    top, left, box_h, box_w = augment._rrc_boxes(u, 16, 16)
    flip = u[..., -1] < 0.5
    out = augment._resized_crop(x, top, left, box_h, box_w, flip)
    for i in range(2):
        for k in range(6):
            t, lft, bh, bw = (int(v[i, k]) for v in (top, left, box_h, box_w))
            crop = x[i : i + 1, :, t : t + bh, lft : lft + bw]
            ref = F.interpolate(
                crop, size=(16, 16), mode="bilinear", align_corners=False, antialias=False
            )[0]
            ref = ref.flip(-1) if flip[i, k] else ref
            torch.testing.assert_close(out[i, k], ref, atol=1e-5, rtol=0)


def naive_rrc_box(u, height, width, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision's RandomResizedCrop.get_params, its retry loop in Python, fed our uniforms."""
    attempts = augment.RRC_ATTEMPTS
    for a in range(attempts):
        target = height * width * (scale[0] + u[a] * (scale[1] - scale[0]))
        aspect = math.exp(
            math.log(ratio[0]) + u[attempts + a] * (math.log(ratio[1]) - math.log(ratio[0]))
        )
        w, h = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return (
                int(u[2 * attempts] * (height - h + 1)),
                int(u[2 * attempts + 1] * (width - w + 1)),
                h,
                w,
            )
    h, w = augment._centre_crop_size(height, width, ratio)
    return (height - h) // 2, (width - w) // 2, h, w


@pytest.mark.parametrize(
    "height, width, scale", [(24, 32, (0.08, 1.0)), (32, 32, (0.08, 1.0)), (32, 16, (0.9, 1.0))]
)
def test_rrc_boxes_equal_torchvision_retry_loop(height, width, scale):
    u = torch.rand(500, 1, augment._RRC_COLUMNS, generator=gen(1), dtype=torch.float64)
    boxes = torch.stack(augment._rrc_boxes(u, height, width, scale=scale), -1).view(500, 4)
    expected = torch.tensor(
        [naive_rrc_box(row.tolist(), height, width, scale) for row in u.view(500, -1)]
    )
    assert torch.equal(boxes, expected)
    top, left, box_h, box_w = boxes.unbind(-1)
    assert (box_h >= 1).all() and (box_w >= 1).all() and (top >= 0).all() and (left >= 0).all()
    assert (top + box_h <= height).all() and (left + box_w <= width).all()
    if scale[0] < 0.5:  # the usual range: areas from 8 % to 100 %, aspect 3/4 .. 4/3 up to rounding
        area = (box_h * box_w).double() / (height * width)
        assert area.min() > 0.06 and area.max() <= 1.0 and 0.35 < area.mean() < 0.6
        aspect = box_w.double() / box_h.double()
        assert aspect.min() > 0.6 and aspect.max() < 1.6


def test_rrc_falls_back_to_torchvision_centre_crop():
    u = torch.rand(3, 2, augment._RRC_COLUMNS, generator=gen(0), dtype=torch.float64)
    # Aspect ratio 2 at full area never fits a square: torchvision's fallback is the whole width,
    # height width / 2, centred.
    top, left, box_h, box_w = augment._rrc_boxes(u, 20, 20, scale=(1.0, 1.0), ratio=(2.0, 2.0))
    assert (box_w == 20).all() and (box_h == 10).all() and (top == 5).all() and (left == 0).all()


@pytest.mark.parametrize("kind", ["rrc", "simclr"])
@pytest.mark.parametrize("value_range", [(-1.0, 1.0), (0.0, 1.0)])
def test_resampled_views_stay_in_value_range(kind, value_range):
    x = images(8, 3, 32, value_range=value_range)
    x[0] = value_range[0]  # saturated images are the easiest to push out of range
    x[1] = value_range[1]
    out = augment_views(x, kind, 4, gen(), value_range=value_range)
    assert out.min() >= value_range[0] - 1e-5 and out.max() <= value_range[1] + 1e-5


# --------------------------------------------------------------------------- simclr colour and blur


def test_hue_shift_and_hsv_round_trip():
    def rgb(*values):
        return torch.tensor(values).view(1, 3, 1, 1)

    torch.testing.assert_close(
        augment._shift_hue(rgb(1.0, 0.0, 0.0), torch.tensor([1 / 3])), rgb(0.0, 1.0, 0.0)
    )
    torch.testing.assert_close(
        augment._shift_hue(rgb(1.0, 0.0, 0.0), torch.tensor([-1 / 3])), rgb(0.0, 0.0, 1.0)
    )
    x = images(4, 3, 8, value_range=(0, 1))
    torch.testing.assert_close(augment._shift_hue(x, torch.zeros(4)), x, atol=1e-6, rtol=0)
    gray = images(4, 1, 8, value_range=(0, 1)).expand(4, 3, 8, 8)  # hue is undefined: unchanged
    torch.testing.assert_close(
        augment._shift_hue(gray, torch.full((4,), 0.1)), gray, atol=1e-6, rtol=0
    )


def test_neutral_jitter_is_identity_and_saturation_zero_is_grayscale():
    x = images(3, 3, 8, value_range=(0, 1))
    neutral = torch.tensor([[1.0, 1.0, 1.0, 0.0]]).expand(3, 4)
    torch.testing.assert_close(augment._colour_jitter(x, neutral), x, atol=1e-6, rtol=0)
    desaturate = torch.tensor([[1.0, 1.0, 0.0, 0.0]]).expand(3, 4)
    out = augment._colour_jitter(x, desaturate)
    torch.testing.assert_close(out, augment._grayscale(x).expand_as(x), atol=1e-6, rtol=0)


def test_blur_keeps_constants_and_tiny_sigma_is_identity():
    const = torch.full((2, 3, 12, 12), 0.3)
    torch.testing.assert_close(augment._gaussian_blur(const, torch.tensor([0.5, 2.0]), 3), const)
    x = images(2, 3, 12, value_range=(0, 1))
    torch.testing.assert_close(
        augment._gaussian_blur(x, torch.tensor([0.1, 0.1]), 3), x, atol=1e-6, rtol=0
    )
    blurred = augment._gaussian_blur(x, torch.tensor([0.1, 2.0]), 5)
    assert blurred[1].std() < x[1].std() * 0.7  # a wide kernel smooths noise
    assert [augment._blur_kernel_size(s, s) for s in (8, 28, 32, 224)] == [3, 3, 3, 23]


def test_simclr_grayscale_probability_and_one_channel_images():
    x = images(100, 3, 16)
    out = augment_views(x, "simclr", 4, gen(0)).reshape(400, 3, -1)
    gray = ((out[:, 0] - out[:, 1]).abs().amax(-1) < 1e-6) & (
        (out[:, 1] - out[:, 2]).abs().amax(-1) < 1e-6
    )
    assert 0.12 < gray.double().mean() < 0.28  # p = 0.2
    one = augment_views(images(4, 1, 28), "simclr", 3, gen(0))
    assert one.shape == (4, 3, 1, 28, 28) and one.min() >= -1 and one.max() <= 1


# --------------------------------------------------------------------------- majority vote


def test_majority_vote_clear_majority_wins_over_confidence():
    # Two views vote class 1 weakly; one view votes class 0 with near certainty: class 1 wins.
    logits = torch.tensor([[[0.0, 0.1, 0.0], [0.0, 0.1, 0.0], [20.0, 0.0, 0.0]]])
    assert majority_vote(logits).tolist() == [1]


def test_majority_vote_tie_goes_to_the_larger_summed_probability():
    # Views vote 0, 2, 1, 2, 0: classes 0 and 2 tie with two votes. Class 2's views are far more
    # confident, so it wins although argmax of the vote counts alone would pick class 0.
    logits = torch.tensor(
        [
            [
                [0.2, 0.0, 0.0],
                [0.0, 0.0, 8.0],
                [0.0, 9.0, 0.0],  # class 1's big probability must not matter: it is not tied
                [0.0, 0.0, 8.0],
                [0.2, 0.0, 0.1],
            ]
        ]
    )
    assert majority_vote(logits).tolist() == [2]
    flipped = logits[..., [2, 1, 0]]  # the same situation with the confident class at index 0
    assert majority_vote(flipped).tolist() == [0]
    with pytest.raises(ValueError, match="classes"):
        majority_vote(torch.zeros(2, 3))


# --------------------------------------------------------------------------- vectorisation


def test_batched_timing_report():
    """No Python loop over examples: 2048 views of 3x32x32 take well under a second per kind on one
    thread. Printed (pytest -s), not asserted, since machines differ."""
    x = images(256, 3, 32)
    for kind in ("crop-flip", "simclr"):
        augment_views(x[:8], kind, 8, gen())  # warm-up
        start = time.perf_counter()
        out = augment_views(x, kind, 8, gen())
        elapsed = time.perf_counter() - start
        print(
            f"augment_views {kind}: 256x3x32x32, K=8 -> {tuple(out.shape)} in {elapsed * 1000:.0f} ms"
        )
    assert math.isfinite(elapsed)


def test_the_runs_padding_reaches_every_view_and_a_negative_one_is_refused():
    """augment.padding (issue 47): the trainer's views (``AugmentViews``) shift by at most that many
    pixels, and the config refuses a negative padding in one line."""
    from dpscale.config import ConfigError, load_config
    from dpscale.train.step import AugmentViews

    x = images(3, 1, 10)
    out = AugmentViews("crop", 64, gen(2), (-1.0, 1.0), padding=1)(x)
    padded = F.pad(x, (1,) * 4, mode="reflect")
    windows = (
        padded.unfold(2, 10, 1).unfold(3, 10, 1).permute(0, 2, 3, 1, 4, 5).reshape(3, 9, 1, 10, 10)
    )
    # offsets within +-1
    assert (out.unsqueeze(2) == windows.unsqueeze(1)).flatten(3).all(-1).any(-1).all()
    assert load_config(None, ["augment.padding=2"]).augment.padding == 2
    with pytest.raises(ConfigError, match="augment.padding must be >= 0"):
        load_config(None, ["augment.padding=-1"])

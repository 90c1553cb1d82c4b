"""Per-view augmentations: shapes, per-example randomness, exactness, reproducibility across resume."""

import pytest
import torch
import torch.nn.functional as F

from dpscale.data.augment import AUGMENTATIONS, augment_views, majority_vote


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _images(n, c, size, seed=0):
    return torch.rand(n, c, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@pytest.mark.parametrize("kind", AUGMENTATIONS)
@pytest.mark.parametrize("c, size", [(1, 28), (3, 32)])
def test_shapes_range_and_reproducibility(kind, c, size):
    x = _images(5, c, size)
    out = augment_views(x, kind, 3, torch.Generator().manual_seed(1))
    assert out.shape == (5, 3, c, size, size) and out.dtype == x.dtype
    assert out.min() >= -1 - 1e-5 and out.max() <= 1 + 1e-5
    assert torch.equal(out, augment_views(x, kind, 3, torch.Generator().manual_seed(1)))
    if kind == "identity":
        assert torch.equal(out, x.unsqueeze(1).expand_as(out))
    else:
        assert not torch.equal(out, augment_views(x, kind, 3, torch.Generator().manual_seed(2)))


@pytest.mark.parametrize("kind", ["crop-flip", "rrc", "simclr"])
def test_parameters_differ_per_view(kind):
    x = _images(1, 3, 32).expand(16, 3, 32, 32)  # 16 identical images, 4 views each
    views = augment_views(x, kind, 4, torch.Generator().manual_seed(0)).reshape(64, -1)
    distinct = torch.unique(views, dim=0).shape[0]
    assert distinct >= 40, distinct  # one draw per batch would give 1 (or 4)


def test_crop_flip_views_are_exact_windows_of_the_padded_image():
    x = _images(3, 2, 12)
    gen = torch.Generator().manual_seed(5)
    out = augment_views(x, "crop-flip", 4, gen, padding=2)
    padded = F.pad(x, (2, 2, 2, 2), mode="reflect")
    for i in range(3):
        for k in range(4):
            candidates = [
                padded[i, :, a : a + 12, b : b + 12].flip(-1) if f else padded[i, :, a : a + 12, b : b + 12]
                for a in range(5) for b in range(5) for f in (False, True)
            ]
            assert any(torch.equal(out[i, k], cand) for cand in candidates), (i, k)


@pytest.mark.parametrize("kind", ["crop-flip", "simclr"])
def test_resume_draws_the_same_views_and_draw_count_ignores_pixels(kind):
    x, other = _images(6, 3, 32, 0), _images(6, 3, 32, 1)
    gen = torch.Generator().manual_seed(3)
    augment_views(x, kind, 2, gen)
    saved = gen.get_state()
    second = augment_views(x, kind, 2, gen)
    restored = torch.Generator()
    restored.set_state(saved)
    assert torch.equal(augment_views(x, kind, 2, restored), second)
    a, b = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    augment_views(x, kind, 2, a)
    augment_views(other, kind, 2, b)
    assert torch.equal(a.get_state(), b.get_state())


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown augmentation"):
        augment_views(_images(1, 1, 8), "mixup", 2, torch.Generator())
    with pytest.raises(ValueError, match=">= 1"):
        augment_views(_images(1, 1, 8), "identity", 0, torch.Generator())
    with pytest.raises(ValueError, match=r"\(N, C, H, W\)"):
        augment_views(torch.zeros(3, 8, 8), "identity", 2, torch.Generator())


def test_majority_vote_and_its_tie_break():
    # Example 0: views vote 2 x class 1, 1 x class 0 -> 1. Example 1: one vote each for classes 0
    # and 2 (a tie); class 2's view is far more confident -> 2.
    logits = torch.tensor([
        [[0.0, 1.0, 0.0], [0.0, 2.0, 0.0], [3.0, 0.0, 0.0]],
        [[0.2, 0.0, 0.0], [0.0, 0.0, 9.0], [-9.0, -9.0, -9.0]],
    ])
    logits[1, 2] = torch.tensor([0.0, 0.5, 0.0])  # third view votes class 1: a three-way tie
    assert majority_vote(logits).tolist() == [1, 2]

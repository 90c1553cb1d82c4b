"""Batched data augmentation with per-view random parameters, for augmentation multiplicity.

AugMult (De et al. 2022; Sander et al. 2023, "TAN without a burn", Appendix C) expands every
training example to K augmented views and clips the mean of their gradients. Each view must get
its own random parameters: torchvision's batch transforms draw one crop/flip/jitter for the whole
batch, which would make all K views of an example (and all examples) identical transformations.
Here every transformation is written for a batch of views with a parameter tensor per view, so a
whole batch is augmented on the training device without a Python loop over examples.

Reproducibility: every call draws all its random numbers at once, as one ``torch.rand`` of shape
``(N, K, P)`` (P fixed per kind) from a CPU generator. The number and order of draws therefore
depend only on N, K and the kind, never on the image content or device, so restoring
``generator.get_state()`` after a checkpoint reproduces the same views after a resume. Parameters
are derived from those uniforms on the CPU (in float64) and only then moved to the data's device.

Kinds (``AUGMENTATIONS``):

- ``identity``: K exact copies; AugMult with identity views is plain DP-SGD (used in tests).
- ``crop-flip`` (TAN's "Ours"): reflect-pad, random integer crop back to H x W, flip p=1/2.
- ``crop``: ``crop-flip`` without the flip: random translations only, for data whose mirror
  image is another distribution (Fashion-MNIST's shoes all point left; digits, text).
- ``rrc``: torchvision's RandomResizedCrop (area 8-100 %, aspect ratio 3/4-4/3 log-uniform,
  bilinear resize without antialiasing), then flip p=1/2.
- ``simclr``: ``rrc``, then colour jitter (p=0.8), grayscale (p=0.2), Gaussian blur (p=0.5).
"""

from __future__ import annotations

import functools
import math
import operator

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["AUGMENTATIONS", "augment_views", "majority_vote"]

AUGMENTATIONS: tuple[str, ...] = ("identity", "crop-flip", "crop", "rrc", "simclr")

FLIP_PROB = 0.5

# Random resized crop, torchvision semantics.
RRC_SCALE = (0.08, 1.0)  # fraction of the image area
RRC_RATIO = (3.0 / 4.0, 4.0 / 3.0)  # width / height, sampled log-uniformly
RRC_ATTEMPTS = 10  # candidates per view, as torchvision's retry loop; then a centre-crop fallback

# SimCLR (Chen et al. 2020) colour distortion and blur.
JITTER_PROB = 0.8
JITTER_STRENGTH = (0.4, 0.4, 0.4, 0.1)  # brightness, contrast, saturation, hue
GRAYSCALE_PROB = 0.2
BLUR_PROB = 0.5
BLUR_SIGMA = (0.1, 2.0)
GRAY_WEIGHTS = (0.2989, 0.587, 0.114)  # ITU-R 601-2 luma, as torchvision's rgb_to_grayscale

# Uniforms drawn per view, by kind. Column layouts:
#   crop-flip: [top, left, flip]
#   crop:      [top, left]
#   rrc:       [area x RRC_ATTEMPTS, log-ratio x RRC_ATTEMPTS, top, left, flip]
#   simclr:    rrc's columns, then [jitter?, brightness, contrast, saturation, hue, gray?, blur?, sigma]
_RRC_COLUMNS = 2 * RRC_ATTEMPTS + 3
_COLOUR_COLUMNS = 8
_COLUMNS = {
    "identity": 0,
    "crop-flip": 3,
    "crop": 2,
    "rrc": _RRC_COLUMNS,
    "simclr": _RRC_COLUMNS + _COLOUR_COLUMNS,
}


def augment_views(
    x: Tensor,
    kind: str,
    multiplicity: int,
    generator: torch.Generator,
    value_range: tuple[float, float] = (-1.0, 1.0),
    padding: int = 4,
) -> Tensor:
    """K randomly augmented views of every image, with independent parameters per view.

    Args:
        x: images [N, C, H, W] on any device (floating point for ``rrc`` and ``simclr``).
        kind: one of ``AUGMENTATIONS``.
        multiplicity: K >= 1, the number of views per image.
        generator: CPU generator all random parameters are drawn from. Each call draws exactly
            ``N * K * P`` uniforms (P fixed per kind), whatever the image content or device.
        value_range: (low, high) of the pixel values; colour operations map it to [0, 1],
            work there and map back, and their output is clipped to this range.
        padding: reflect padding of ``crop-flip`` and ``crop``, in pixels; offsets are uniform in
            [0, 2 * padding]. Must be smaller than H and W.

    Returns:
        Views [N, K, C, H, W] on ``x``'s device with ``x``'s dtype; view ``[i, k]`` is an
        augmentation of ``x[i]``.

    Raises:
        ValueError: unknown ``kind``, ``multiplicity < 1``, ``x`` not 4-D, a non-CPU generator,
            an empty value range or an unusable ``padding``.
    """
    if kind not in AUGMENTATIONS:
        raise ValueError(
            f"unknown augmentation {kind!r}; expected one of {', '.join(AUGMENTATIONS)}"
        )
    if multiplicity < 1:
        raise ValueError(f"multiplicity must be >= 1, got {multiplicity}")
    if x.dim() != 4:
        raise ValueError(f"expected images (N, C, H, W), got shape {tuple(x.shape)}")
    if generator.device.type != "cpu":
        # A CPU generator makes the draws identical whatever device the images live on.
        raise ValueError(f"augment_views needs a CPU generator, got one on {generator.device}")
    low, high = value_range
    if not high > low:
        raise ValueError(f"value_range must be (low, high) with low < high, got {value_range}")
    n, c, h, w = x.shape
    if kind in ("crop-flip", "crop") and not 0 <= padding < min(h, w):
        raise ValueError(
            f"padding must be in [0, {min(h, w) - 1}] for {h}x{w} images, got {padding}"
        )
    if kind in ("rrc", "simclr") and not x.is_floating_point():
        raise ValueError(f"{kind} interpolates and needs floating-point images, got {x.dtype}")

    uniforms = _draw_uniforms(generator, n, multiplicity, _COLUMNS[kind])
    if kind == "identity" or n == 0:  # (affine_grid refuses empty batches)
        return x.unsqueeze(1).expand(n, multiplicity, c, h, w).clone()
    if kind in ("crop-flip", "crop"):
        top, left, flip = _crop_flip_params(uniforms, padding)
        return _crop_flip(x, top, left, flip, padding)
    top, left, box_h, box_w = _rrc_boxes(uniforms[..., :_RRC_COLUMNS], h, w)
    views = _resized_crop(x, top, left, box_h, box_w, uniforms[..., _RRC_COLUMNS - 1] < FLIP_PROB)
    if kind == "rrc":
        return views
    return _colour_and_blur(views, uniforms[..., _RRC_COLUMNS:], value_range)


def majority_vote(logits: Tensor) -> Tensor:
    """Test-time augmentation (TAN's AugTest): the class most of an image's views predict.

    Each view votes for its argmax class. Ties between classes with the same number of votes go
    to the tied class with the larger softmax probability summed over the views; an exact tie in
    that sum too goes to the smallest class index.

    Args:
        logits: [N, K, classes] logits of the K views of each of N images.

    Returns:
        Predicted classes [N] (int64) on ``logits``' device.
    """
    if logits.dim() != 3:
        raise ValueError(f"expected logits [N, K, classes], got shape {tuple(logits.shape)}")
    num_classes = logits.shape[-1]
    votes = F.one_hot(logits.argmax(-1), num_classes).sum(1)  # [N, classes]
    confidence = logits.float().softmax(-1).sum(1)
    tied = votes == votes.amax(-1, keepdim=True)
    return torch.where(tied, confidence, torch.full_like(confidence, -math.inf)).argmax(-1)


# --------------------------------------------------------------------------- random parameters


def _draw_uniforms(generator: torch.Generator, n: int, views: int, columns: int) -> Tensor:
    """All of one call's randomness: U[0, 1) of shape [n, views, columns], float64, CPU.

    One draw of a fixed shape is what keeps the generator's advance independent of the data."""
    if columns == 0:
        return torch.empty(n, views, 0, dtype=torch.float64)
    return torch.rand(n, views, columns, generator=generator, dtype=torch.float64)


def _uniform_int(u: Tensor, count: Tensor | int) -> Tensor:
    """Integers uniform in [0, count) from uniforms u in [0, 1) (clamped against rounding)."""
    count = torch.as_tensor(count, dtype=torch.float64)
    return torch.minimum(torch.floor(u * count), count - 1).to(torch.int64)


def _crop_flip_params(u: Tensor, padding: int) -> tuple[Tensor, Tensor, Tensor]:
    """Crop offsets in [0, 2 * padding] and flip flags, each [N, K], from uniforms [N, K, 3]
    (crop-flip) or [N, K, 2] (crop: no flip column, never flipped)."""
    flip = u[..., 2] < FLIP_PROB if u.shape[-1] > 2 else torch.zeros(u.shape[:-1], dtype=torch.bool)
    return _uniform_int(u[..., 0], 2 * padding + 1), _uniform_int(u[..., 1], 2 * padding + 1), flip


def _rrc_boxes(
    u: Tensor,
    height: int,
    width: int,
    scale: tuple[float, float] = RRC_SCALE,
    ratio: tuple[float, float] = RRC_RATIO,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Crop boxes of torchvision's RandomResizedCrop.get_params, for every view at once.

    torchvision retries up to 10 (area, aspect) candidates until one fits in the image, then
    falls back to a centre crop. Here the retry is vectorised exactly: every view draws all
    ``RRC_ATTEMPTS`` candidates, takes the first that fits, and views where none fits take the
    same centre crop as torchvision. The box distribution is therefore torchvision's.

    Args:
        u: uniforms [..., 2 * RRC_ATTEMPTS + 3] (areas, log-ratios, top, left; the last column,
            the flip, is unused here).
        height, width: image size.
        scale: range of the crop's area as a fraction of the image's.
        ratio: range of the crop's aspect ratio (width / height), sampled log-uniformly.

    Returns:
        top, left, box height, box width: int64 tensors of shape ``u.shape[:-1]``.
    """
    attempts = RRC_ATTEMPTS
    area = height * width * (scale[0] + u[..., :attempts] * (scale[1] - scale[0]))
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(log_lo + u[..., attempts : 2 * attempts] * (log_hi - log_lo))
    # torch.round rounds half to even, like the Python round() torchvision uses.
    cand_w = torch.round(torch.sqrt(area * aspect))
    cand_h = torch.round(torch.sqrt(area / aspect))
    fits = (cand_w > 0) & (cand_w <= width) & (cand_h > 0) & (cand_h <= height)
    first = fits.to(torch.int8).argmax(-1, keepdim=True)  # index of the first fitting candidate
    found = fits.any(-1)

    fallback_h, fallback_w = _centre_crop_size(height, width, ratio)
    box_w = torch.where(found, cand_w.gather(-1, first).squeeze(-1), float(fallback_w)).to(
        torch.int64
    )
    box_h = torch.where(found, cand_h.gather(-1, first).squeeze(-1), float(fallback_h)).to(
        torch.int64
    )
    top = torch.where(
        found, _uniform_int(u[..., 2 * attempts], height - box_h + 1), (height - box_h) // 2
    )
    left = torch.where(
        found, _uniform_int(u[..., 2 * attempts + 1], width - box_w + 1), (width - box_w) // 2
    )
    return top, left, box_h, box_w


def _centre_crop_size(height: int, width: int, ratio: tuple[float, float]) -> tuple[int, int]:
    """torchvision's fallback box (height, width): the whole image, with its aspect ratio clamped
    to ``ratio``."""
    in_ratio = width / height
    if in_ratio < min(ratio):
        return int(round(width / min(ratio))), width
    if in_ratio > max(ratio):
        return height, int(round(height * max(ratio)))
    return height, width


# --------------------------------------------------------------------------- geometric transforms


def _crop_flip(x: Tensor, top: Tensor, left: Tensor, flip: Tensor, padding: int) -> Tensor:
    """Views [N, K, C, H, W]: the H x W window at (top, left) of the reflect-padded image, then
    mirrored where ``flip``. Params are [N, K]; an exact pixel copy (advanced indexing)."""
    n, c, h, w = x.shape
    device = x.device
    padded = F.pad(x, (padding,) * 4, mode="reflect") if padding else x
    top, left, flip = top.to(device), left.to(device), flip.to(device)
    rows = top[..., None] + torch.arange(h, device=device)  # [N, K, H]
    cols_fwd = torch.arange(w, device=device)
    # A flipped view reads its window right to left: flipping after cropping in one gather.
    cols = left[..., None] + torch.where(flip[..., None], w - 1 - cols_fwd, cols_fwd)  # [N, K, W]
    image = torch.arange(n, device=device).view(n, 1, 1, 1, 1)
    channel = torch.arange(c, device=device).view(1, 1, c, 1, 1)
    return padded[image, channel, rows[:, :, None, :, None], cols[:, :, None, None, :]]


def _resized_crop(
    x: Tensor, top: Tensor, left: Tensor, box_h: Tensor, box_w: Tensor, flip: Tensor
) -> Tensor:
    """Views [N, K, C, H, W]: each box [top, top + box_h) x [left, left + box_w) of x resized
    bilinearly to H x W (align_corners=False, no antialiasing), mirrored where ``flip``.

    Equals cropping then ``F.interpolate(..., mode="bilinear", align_corners=False)`` per view:
    sample points are clamped to the box's outermost pixel centres, as resizing the cropped
    tensor clamps at its border, instead of blending in pixels just outside the box. Sampling
    points are convex combinations of input pixels, so the output stays in the input's range.
    """
    n, c, h, w = x.shape
    k = top.shape[1]
    top, left, box_h, box_w = (t.reshape(-1).to(torch.float64) for t in (top, left, box_h, box_w))
    flip = flip.reshape(-1)
    # Affine map from output to input normalised coordinates (align_corners=False: -1 and 1 are
    # the image's outer pixel edges); a negative x-scale mirrors the view.
    scale_x = torch.where(flip, -box_w / w, box_w / w)
    scale_y = box_h / h
    theta = torch.zeros(n * k, 2, 3, dtype=torch.float64)
    theta[:, 0, 0], theta[:, 0, 2] = scale_x, (2 * left + box_w) / w - 1
    theta[:, 1, 1], theta[:, 1, 2] = scale_y, (2 * top + box_h) / h - 1
    low = torch.stack([(2 * left + 1) / w - 1, (2 * top + 1) / h - 1], -1)
    high = torch.stack([(2 * (left + box_w) - 1) / w - 1, (2 * (top + box_h) - 1) / h - 1], -1)

    # Tensor.to(x): x's device and dtype
    grid = F.affine_grid(theta.to(x), [n * k, c, h, w], align_corners=False)  # [N*K, H, W, 2]
    grid = torch.maximum(
        torch.minimum(grid, high.to(x).view(-1, 1, 1, 2)), low.to(x).view(-1, 1, 1, 2)
    )
    # The K grids of an image are stacked along the output height, so grid_sample reads each image
    # once instead of needing K repeated copies of it.
    out = F.grid_sample(
        x, grid.view(n, k * h, w, 2), mode="bilinear", padding_mode="border", align_corners=False
    )
    return out.view(n, c, k, h, w).transpose(1, 2).contiguous()


# --------------------------------------------------------------------------- colour and blur


def _colour_and_blur(views: Tensor, u: Tensor, value_range: tuple[float, float]) -> Tensor:
    """SimCLR's appearance distortions on views [N, K, C, H, W], parameters from uniforms
    [N, K, 8]: colour jitter (p=0.8), grayscale (p=0.2), Gaussian blur (p=0.5).

    Jitter applies brightness, contrast, saturation, hue in that fixed order (torchvision shuffles
    the order per call); each view has its own factors. Saturation, hue and grayscale need RGB and
    are skipped unless C == 3; their uniforms are drawn regardless. Every operation is computed
    for all views and kept where the view's coin says so, which avoids data-dependent shapes
    (and device syncs)."""
    n, k, c, h, w = views.shape
    low, high = value_range
    img = ((views.reshape(n * k, c, h, w) - low) / (high - low)).clamp(0, 1)
    p = u.reshape(n * k, _COLOUR_COLUMNS).to(device=img.device, dtype=img.dtype)
    strength = torch.tensor(JITTER_STRENGTH, device=img.device, dtype=img.dtype)
    # Brightness, contrast and saturation factors are uniform in [1 - s, 1 + s]; the hue shift is
    # uniform in [-s, s] (in turns of the colour wheel).
    factors = (2 * p[:, 1:5] - 1) * strength + torch.tensor(
        [1.0, 1.0, 1.0, 0.0], device=img.device, dtype=img.dtype
    )

    img = _where_view(p[:, 0] < JITTER_PROB, _colour_jitter(img, factors), img)
    if c == 3:
        img = _where_view(p[:, 5] < GRAYSCALE_PROB, _grayscale(img).expand_as(img), img)
    sigma = BLUR_SIGMA[0] + p[:, 7] * (BLUR_SIGMA[1] - BLUR_SIGMA[0])
    img = _where_view(p[:, 6] < BLUR_PROB, _gaussian_blur(img, sigma, _blur_kernel_size(h, w)), img)
    # Clamp again: mapping back can overshoot the range by a rounding error.
    return (img * (high - low) + low).clamp(low, high).view(n, k, c, h, w)


def _where_view(mask: Tensor, new: Tensor, old: Tensor) -> Tensor:
    """Per-view select: ``new[v]`` where ``mask[v]`` else ``old[v]``, for [V, C, H, W] tensors."""
    return torch.where(mask.view(-1, 1, 1, 1), new, old)


def _colour_jitter(img: Tensor, factors: Tensor) -> Tensor:
    """torchvision's adjust_brightness/contrast/saturation/hue, with per-view factors [V, 4]
    (brightness, contrast, saturation, hue shift), on images [V, C, H, W] in [0, 1]."""
    col = [factors[:, i].view(-1, 1, 1, 1) for i in range(4)]
    img = (img * col[0]).clamp(0, 1)
    gray_mean = (_grayscale(img) if img.shape[1] == 3 else img).mean((1, 2, 3), keepdim=True)
    img = _blend(img, gray_mean, col[1])
    if img.shape[1] == 3:
        img = _blend(img, _grayscale(img), col[2])
        img = _shift_hue(img, factors[:, 3])
    return img


def _blend(img: Tensor, other: Tensor, factor: Tensor) -> Tensor:
    """factor * img + (1 - factor) * other, clipped to [0, 1] (torchvision's _blend)."""
    return (factor * img + (1 - factor) * other).clamp(0, 1)


def _grayscale(img: Tensor) -> Tensor:
    """Luma [V, 1, H, W] of RGB images [V, 3, H, W]."""
    weights = torch.tensor(GRAY_WEIGHTS, device=img.device, dtype=img.dtype).view(1, 3, 1, 1)
    return (img * weights).sum(1, keepdim=True)


def _shift_hue(img: Tensor, shift: Tensor) -> Tensor:
    """Rotate the hue of RGB images [V, 3, H, W] in [0, 1] by ``shift`` [V] turns."""
    hue, sat, val = _rgb_to_hsv(img)
    return _hsv_to_rgb(torch.remainder(hue + shift.view(-1, 1, 1), 1.0), sat, val)


def _rgb_to_hsv(img: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Hue in [0, 1), saturation, value, each [V, H, W], of RGB images [V, 3, H, W] in [0, 1]."""
    r, g, b = img.unbind(1)
    maxc, minc = img.amax(1), img.amin(1)
    chroma = maxc - minc
    grey = chroma == 0
    ones = torch.ones_like(maxc)
    sat = chroma / torch.where(grey, ones, maxc)  # grey pixels (incl. black) have saturation 0
    safe = torch.where(grey, ones, chroma)
    rc, gc, bc = (maxc - r) / safe, (maxc - g) / safe, (maxc - b) / safe
    hue = torch.where(maxc == r, bc - gc, torch.where(maxc == g, 2.0 + rc - bc, 4.0 + gc - rc))
    return torch.remainder(hue / 6.0, 1.0), sat, maxc


def _hsv_to_rgb(hue: Tensor, sat: Tensor, val: Tensor) -> Tensor:
    """RGB images [V, 3, H, W] from hue, saturation, value [V, H, W]; the branch-free formula
    f(n) = V - V S clamp(min(k, 4 - k), 0, 1) with k = (n + 6 H) mod 6, n = 5, 3, 1 for R, G, B."""
    n = torch.tensor([5.0, 3.0, 1.0], device=hue.device, dtype=hue.dtype).view(1, 3, 1, 1)
    sector = torch.remainder(n + 6.0 * hue.unsqueeze(1), 6.0)
    ramp = torch.minimum(sector, 4.0 - sector).clamp(0, 1)
    return val.unsqueeze(1) * (1 - sat.unsqueeze(1) * ramp)


def _blur_kernel_size(height: int, width: int) -> int:
    """SimCLR's kernel: about 10 % of the image side, odd, at least 3 (so small images are still
    blurred) and small enough for reflect padding."""
    side = min(height, width)
    size = int(0.1 * side)
    size = max(3, size + 1 - size % 2)
    return min(size, 2 * side - 1)


def _gaussian_blur(img: Tensor, sigma: Tensor, kernel_size: int) -> Tensor:
    """Separable Gaussian blur of [V, C, H, W] with a per-view sigma [V] and reflect padding (as
    torchvision's gaussian_blur). Each pass is a sum over the kernel's taps of shifted images
    weighted per view: a loop over taps, never over views."""
    v, c, h, w = img.shape
    half = kernel_size // 2
    taps = torch.arange(-half, half + 1, device=img.device, dtype=img.dtype)
    kernel = torch.exp(-0.5 * (taps / sigma.view(-1, 1)) ** 2)
    kernel = kernel / kernel.sum(-1, keepdim=True)  # [V, taps]; normalised, so the range is kept
    padded = F.pad(img, (half, half, half, half), mode="reflect")
    # the taps added in order (sum() would start from the int 0); a kernel has at least one tap
    rows = functools.reduce(
        operator.add,
        (kernel[:, i].view(-1, 1, 1, 1) * padded[:, :, i : i + h, :] for i in range(kernel_size)),
    )
    return functools.reduce(
        operator.add,
        (kernel[:, i].view(-1, 1, 1, 1) * rows[:, :, :, i : i + w] for i in range(kernel_size)),
    )

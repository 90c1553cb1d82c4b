"""Batched image augmentations with per-view random parameters, for augmentation multiplicity.

AugMult (De et al. 2022; TAN, Sander et al. 2023, eq. 5) expands each training example into K
views. Each view needs its *own* random crop/flip/colour parameters. torchvision's batch
transforms draw one set per batch, which is what we must not do. Here every view's parameters
are drawn at once from a CPU ``torch.Generator``. The number and order of draws depends only on
the batch shape, never on the pixels, so a run that checkpoints the generator draws the same
views after a resume, on any device. The image operations then run batched on the input's
device, with no Python loop over examples.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

AUGMENTATIONS: tuple[str, ...] = ("identity", "crop-flip", "rrc", "simclr")
RRC_AREA = (0.08, 1.0)  # fraction of the image area kept by a random resized crop
RRC_RATIO = (3 / 4, 4 / 3)  # its aspect-ratio range (log-uniform)
JITTER = {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4, "hue": 0.1}  # SimCLR's strengths
P_JITTER, P_GRAY, P_BLUR = 0.8, 0.2, 0.5
BLUR_SIGMA = (0.1, 2.0)


def augment_views(
    x: torch.Tensor,
    kind: str,
    multiplicity: int,
    generator: torch.Generator,
    value_range: tuple[float, float] = (-1.0, 1.0),
    padding: int = 4,
) -> torch.Tensor:
    """K augmented views of every image, each with its own random parameters.

    Args:
        x: images (N, C, H, W), on any device.
        kind: one of ``AUGMENTATIONS``.
        multiplicity: K >= 1.
        generator: CPU generator for every random parameter (advanced by a data-independent amount).
        value_range: (low, high) of the pixel values (colour operations work in [0, 1]).
        padding: reflect padding of ``crop-flip``, in pixels.

    Returns:
        (N, K, C, H, W) on x's device and dtype.
    """
    if kind not in AUGMENTATIONS:
        raise ValueError(f"unknown augmentation {kind!r}; choose one of {', '.join(AUGMENTATIONS)}")
    if multiplicity < 1:
        raise ValueError(f"augmentation multiplicity must be >= 1, got {multiplicity}")
    if x.dim() != 4:
        raise ValueError(f"augment_views expects images (N, C, H, W), got shape {tuple(x.shape)}")
    n, c, h, w = x.shape
    views = x.unsqueeze(1).expand(n, multiplicity, c, h, w).reshape(n * multiplicity, c, h, w)
    if kind == "identity":
        out = views.clone()
    elif kind == "crop-flip":
        out = _crop_flip(views, generator, padding)
    else:
        out = _resized_crop_flip(views, generator)
        if kind == "simclr":
            out = _simclr_colour(out, generator, value_range)
    return out.reshape(n, multiplicity, c, h, w)


def _uniform(m: int, low: float, high: float, generator: torch.Generator) -> torch.Tensor:
    return low + (high - low) * torch.rand(m, generator=generator, dtype=torch.float64)


def _crop_flip(x: torch.Tensor, generator: torch.Generator, padding: int) -> torch.Tensor:
    """Reflect-pad, crop back at a random integer offset, flip with p=1/2: an exact pixel copy."""
    m, _, h, w = x.shape
    top = torch.randint(0, 2 * padding + 1, (m,), generator=generator)
    left = torch.randint(0, 2 * padding + 1, (m,), generator=generator)
    flip = torch.rand(m, generator=generator) < 0.5
    padded = F.pad(x, (padding, padding, padding, padding), mode="reflect") if padding else x
    device = x.device
    rows = (top.unsqueeze(1) + torch.arange(h)).to(device)  # (M, H)
    cols = torch.arange(w).expand(m, w)
    cols = torch.where(flip.unsqueeze(1), cols.flip(1), cols)
    cols = (left.unsqueeze(1) + cols).to(device)  # (M, W)
    picked = padded[torch.arange(m, device=device)[:, None, None], :, rows[:, :, None], cols[:, None, :]]
    return picked.permute(0, 3, 1, 2).contiguous()  # advanced indexing put channels last


def _resized_crop_flip(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random resized crop (area fraction U(0.08, 1), aspect log-U(3/4, 4/3)) and flip p=1/2.

    torchvision retries until the crop fits and falls back to a centre crop. Here a crop that
    would not fit is shrunk to fit along the overflowing side (one draw per view, vectorised),
    which keeps its centre random and its area at most the drawn one.
    """
    m, _, h, w = x.shape
    area = _uniform(m, *RRC_AREA, generator)
    log_ratio = _uniform(m, math.log(RRC_RATIO[0]), math.log(RRC_RATIO[1]), generator)
    u_x, u_y = _uniform(m, 0, 1, generator), _uniform(m, 0, 1, generator)
    flip = torch.rand(m, generator=generator) < 0.5
    ratio = log_ratio.exp()
    # Crop width/height as fractions of the image width/height.
    frac_w = ((area * h * w * ratio).sqrt() / w).clamp(max=1.0)
    frac_h = ((area * h * w / ratio).sqrt() / h).clamp(max=1.0)
    centre_x = u_x * (1 - frac_w) + frac_w / 2  # in [0, 1] image coordinates
    centre_y = u_y * (1 - frac_h) + frac_h / 2
    sign = torch.where(flip, -1.0, 1.0).to(torch.float64)
    theta = torch.zeros(m, 2, 3, dtype=torch.float64)
    theta[:, 0, 0] = frac_w * sign
    theta[:, 0, 2] = 2 * centre_x - 1
    theta[:, 1, 1] = frac_h
    theta[:, 1, 2] = 2 * centre_y - 1
    theta = theta.to(device=x.device, dtype=x.dtype)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection", align_corners=False)


def _grayscale(z: torch.Tensor) -> torch.Tensor:
    """ITU-R 601 luma of RGB images in [0, 1], (M, 1, H, W)."""
    r, g, b = z[:, 0:1], z[:, 1:2], z[:, 2:3]
    return 0.299 * r + 0.587 * g + 0.114 * b


def _rotate_hue(z: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """Rotate the chroma of RGB images by ``turns`` (fractions of a full turn) in YIQ space."""
    to_yiq = z.new_tensor([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])
    from_yiq = torch.linalg.inv(to_yiq)
    yiq = torch.einsum("ij,mjhw->mihw", to_yiq, z)
    angle = (2 * math.pi * turns).view(-1, 1, 1)
    cos, sin = angle.cos(), angle.sin()
    i, q = yiq[:, 1], yiq[:, 2]
    yiq = torch.stack([yiq[:, 0], cos * i - sin * q, sin * i + cos * q], dim=1)
    return torch.einsum("ij,mjhw->mihw", from_yiq, yiq)


def _gaussian_blur(z: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Separable Gaussian blur with a per-view sigma; kernel ~10% of the image side (odd, >= 3)."""
    m, c, h, w = z.shape
    size = max(3, int(0.1 * min(h, w)) // 2 * 2 + 1)
    offsets = torch.arange(size, device=z.device, dtype=z.dtype) - size // 2
    kernel = torch.exp(-(offsets**2) / (2 * sigma.view(-1, 1) ** 2))
    kernel = (kernel / kernel.sum(1, keepdim=True)).repeat_interleave(c, dim=0)  # (M*C, size)
    flat = F.pad(z.reshape(1, m * c, h, w), (size // 2,) * 4, mode="reflect")
    flat = F.conv2d(flat, kernel.view(m * c, 1, size, 1), groups=m * c)
    flat = F.conv2d(flat, kernel.view(m * c, 1, 1, size), groups=m * c)
    return flat.reshape(m, c, h, w)


def _simclr_colour(x: torch.Tensor, generator: torch.Generator, value_range: tuple[float, float]) -> torch.Tensor:
    """SimCLR's colour jitter (p=0.8), grayscale (p=0.2) and Gaussian blur (p=0.5), per view.

    Jitter order is fixed (brightness, contrast, saturation, hue). Saturation, hue and
    grayscale are no-ops on one-channel images, but their random numbers are still drawn.
    """
    m, c = x.shape[:2]
    draws = {
        "jitter": torch.rand(m, generator=generator) < P_JITTER,
        "brightness": _uniform(m, 1 - JITTER["brightness"], 1 + JITTER["brightness"], generator),
        "contrast": _uniform(m, 1 - JITTER["contrast"], 1 + JITTER["contrast"], generator),
        "saturation": _uniform(m, 1 - JITTER["saturation"], 1 + JITTER["saturation"], generator),
        "hue": _uniform(m, -JITTER["hue"], JITTER["hue"], generator),
        "gray": torch.rand(m, generator=generator) < P_GRAY,
        "blur": torch.rand(m, generator=generator) < P_BLUR,
        "sigma": _uniform(m, *BLUR_SIGMA, generator),
    }
    d = {k: v.to(device=x.device, dtype=x.dtype if v.is_floating_point() else v.dtype) for k, v in draws.items()}
    per_view = lambda t: t.view(-1, 1, 1, 1)  # noqa: E731
    low, high = value_range
    z = ((x - low) / (high - low)).clamp(0, 1)

    jittered = (z * per_view(d["brightness"])).clamp(0, 1)
    luma = _grayscale(jittered) if c == 3 else jittered
    mean = luma.mean(dim=(1, 2, 3), keepdim=True)
    jittered = ((jittered - mean) * per_view(d["contrast"]) + mean).clamp(0, 1)
    if c == 3:
        luma = _grayscale(jittered)
        jittered = ((jittered - luma) * per_view(d["saturation"]) + luma).clamp(0, 1)
        jittered = _rotate_hue(jittered, d["hue"]).clamp(0, 1)
    z = torch.where(per_view(d["jitter"]), jittered, z)
    if c == 3:
        z = torch.where(per_view(d["gray"]), _grayscale(z).expand_as(z), z)
    z = torch.where(per_view(d["blur"]), _gaussian_blur(z, d["sigma"]), z)
    return z * (high - low) + low


def majority_vote(logits: torch.Tensor) -> torch.Tensor:
    """Predicted class per example from K views' logits (N, K, classes): the class most views
    predict; a tie goes to the tied class with the larger summed softmax probability.

    Returns:
        (N,) class indices.
    """
    views, classes = logits.shape[1], logits.shape[2]
    votes = F.one_hot(logits.argmax(2), classes).sum(1).to(logits.dtype)  # (N, classes)
    probability = logits.softmax(2).sum(1)  # in [0, K]: a fraction of one vote after scaling
    return (votes + probability / (views + 1)).argmax(1)

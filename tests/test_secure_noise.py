"""dp.secure_noise: the noise from the OS CSPRNG is standard normal, never reproducible, and
leaves no generator state in checkpoints."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn

import dpscale
from dpscale.cli import main
from dpscale.privacy.noise.gaussian import add_gaussian_noise
from dpscale.privacy.plan.caveat_texts import SEEDED_SECURE_NOISE_CAVEAT
from dpscale.rng import SECURE_SOURCE, DPRandom, SecureRandom


def test_secure_normals_are_standard_normal():
    n = 2_000_000
    x = SecureRandom().normal((n,), dtype=torch.float64).numpy()
    assert abs(x.mean()) < 6 / math.sqrt(n)
    assert abs(x.var() - 1) < 6 * math.sqrt(2 / n)
    assert abs(stats.kurtosis(x, fisher=False) - 3) < 6 * math.sqrt(24 / n)
    assert stats.kstest(x[:200_000], "norm").pvalue > 1e-6
    # neighbours (Box-Muller pairs) uncorrelated
    assert abs(np.corrcoef(x[:-1], x[1:])[0, 1]) < 6 / math.sqrt(n)
    assert abs(np.corrcoef(x[0::2] ** 2, x[1::2] ** 2)[0, 1]) < 6 / math.sqrt(n / 2)


def test_noise_std_is_sigma_c():
    sigma, clip = 1.7, 1.5
    zeros = {"w": torch.zeros(1000, 1000)}
    noisy = add_gaussian_noise(zeros, sigma * clip, SecureRandom())["w"].double()
    n = noisy.numel()
    assert abs(noisy.std().item() / (sigma * clip) - 1) < 6 * math.sqrt(1 / (2 * n))
    assert noisy.dtype == torch.float64 and abs(noisy.mean().item()) < 6 * sigma * clip / math.sqrt(
        n
    )


def test_secure_state_holds_nothing():
    generator = SecureRandom()
    assert generator.state_dict() == {"bit_generator": SECURE_SOURCE}
    generator.load_state_dict(generator.state_dict())
    with pytest.raises(ValueError, match="seeded generator"):
        generator.load_state_dict(DPRandom(0).state_dict())
    with pytest.raises(ValueError, match="resume it with dp.secure_noise"):
        DPRandom(0).load_state_dict(generator.state_dict())
    a, b = SecureRandom().normal((8,)), SecureRandom().normal((8,))
    assert not torch.equal(a, b)


def _weights(run_dir):
    return torch.load(run_dir / "checkpoint.pt", weights_only=False)


@pytest.mark.parametrize("secure", [False, True])
def test_same_seed_differs_only_with_secure_noise(tmp_path, secure):
    for name in ("a", "b"):
        code = main(
            [
                "train",
                "--quiet",
                "--set",
                f"run.out_dir={tmp_path / name}",
                "--set",
                "run.seed=0",
                "--set",
                "train.steps=5",
                "--set",
                f"dp.secure_noise={str(secure).lower()}",
            ]
        )
        assert code == 0
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    same = all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert same != secure  # the control (secure off) shows the comparison can fail
    if secure:
        # no state to reproduce the noise
        assert a["mechanism"]["noise_generator"] == {"bit_generator": SECURE_SOURCE}


def test_secure_run_resumes_with_fresh_noise(tmp_path, capsys):
    args = [
        "--set",
        f"run.out_dir={tmp_path / 'r'}",
        "--set",
        "run.seed=0",
        "--set",
        "train.steps=6",
        "--set",
        "dp.secure_noise=true",
    ]
    assert main(["train", "--quiet", "--max-steps", "3", *args]) == 0
    assert main(["train", "--quiet", "--resume", str(tmp_path / "r")]) == 0
    state = _weights(tmp_path / "r")
    assert state["step"] == 6 and state["mechanism"]["noise_generator"] == {
        "bit_generator": SECURE_SOURCE
    }
    out = capsys.readouterr()
    assert SEEDED_SECURE_NOISE_CAVEAT in out.out + out.err


def test_make_private_secure_noise():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mechanism = dpscale.make_private(
        model,
        optimizer,
        dataset_size=100,
        batch_size=10,
        max_grad_norm=1.0,
        delta=1e-5,
        noise_multiplier=1.0,
        steps=2,
        seed=0,
        secure_noise=True,
    )
    assert isinstance(mechanism.noise_generator, SecureRandom) and mechanism.plan.secure_noise
    indices = mechanism.sample()
    mechanism.step(torch.randn(len(indices), 4), torch.zeros(len(indices), dtype=torch.long))
    assert mechanism.state_dict()["noise_generator"] == {"bit_generator": SECURE_SOURCE}

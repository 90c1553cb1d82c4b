"""Layers that per-example clipping refuses (issue 24). torch's RNN/GRU/LSTM (and cells) and an
Embedding with max_norm (a hidden in-place write of the weight) or sparse gradients used to fail
inside torch from every engine; each now gets a one-line refusal from ``make_engine`` (every
engine path) naming the layer's path in the model and the way out. What an engine can compute
exactly (a frozen recurrent layer under bk, a recurrence of Linear layers under vmap) is checked
against a float64 per-example loop instead of being refused."""

import pytest
import torch
from torch import nn

import dpscale
from dpscale.privacy.clipping.engines import make_engine, supported_engines
from dpscale.choices import ENGINE_NAMES
from dpscale.privacy.clipping.per_example import trainable_params
from dpscale.privacy.clipping.layer_refusals import check_per_example_compatible
from dpscale.privacy.clipping.reference import float64_reference

FEATURES, HIDDEN, CLASSES, STEPS, VOCAB = 4, 5, 3, 6, 11
CLIP = 0.5
RECURRENT = {
    "RNN": lambda: nn.RNN(FEATURES, HIDDEN, batch_first=True),
    "GRU": lambda: nn.GRU(FEATURES, HIDDEN, batch_first=True),
    "LSTM": lambda: nn.LSTM(FEATURES, HIDDEN, num_layers=2, batch_first=True),
    "RNNCell": lambda: nn.RNNCell(FEATURES, HIDDEN),
    "GRUCell": lambda: nn.GRUCell(FEATURES, HIDDEN),
    "LSTMCell": lambda: nn.LSTMCell(FEATURES, HIDDEN),
}


class Scale(nn.Module):
    """A parameter no bk/ghost rule knows: makes ``auto`` fall back to vmap."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class Recurrent(nn.Module):
    """inp (Linear) -> encoder.rnn (torch's recurrent layer or cell) -> extra -> head."""

    def __init__(self, rnn: nn.Module, extra: nn.Module | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, FEATURES)
        self.encoder = nn.ModuleDict({"rnn": rnn})
        self.extra = extra or nn.Identity()
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, rnn = self.inp(x), self.encoder["rnn"]
        state = rnn(x[:, 0]) if isinstance(rnn, nn.RNNCellBase) else rnn(x)[0][:, -1]
        state = state[0] if isinstance(state, tuple) else state  # LSTMCell: (h, c)
        return self.head(self.extra(state))


class Embedded(nn.Module):
    """encoder.embed (Embedding or EmbeddingBag) -> head."""

    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        self.encoder = nn.ModuleDict({"embed": embed})
        self.head = nn.Linear(
            HIDDEN * (1 if isinstance(embed, nn.EmbeddingBag) else STEPS), CLASSES
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder["embed"](tokens).flatten(1))


class LinearRecurrence(nn.Module):
    """The way out for a trainable RNN: h_t = tanh(ih(x_t) + hh(h_{t-1})) with nn.Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.ih, self.hh, self.head = (
            nn.Linear(FEATURES, HIDDEN),
            nn.Linear(HIDDEN, HIDDEN),
            nn.Linear(HIDDEN, CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], HIDDEN)
        for t in range(x.shape[1]):
            h = torch.tanh(self.ih(x[:, t]) + self.hh(h))
        return self.head(h)


def sequences(n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, STEPS, FEATURES, generator=g), torch.randint(
        0, CLASSES, (n,), generator=g
    )


def assert_exact(engine_name: str, model: nn.Module) -> None:
    """The engine's float32 clipped sum equals the float64 loop. Every clipped per-example gradient
    has norm <= C, so float32 rounding (~1e-7 of it here) is judged against C, with 100x margin."""
    x, y = sequences()
    engine, _ = make_engine(engine_name, CLIP, model)
    got, norms = engine.per_example_clipped_sum(model, trainable_params(model), (x, y))
    want = float64_reference(model, (x, y), CLIP)  # the per-example loop on a float64 copy
    torch.testing.assert_close(norms.double(), want.norms, rtol=1e-5, atol=0.0, msg=engine_name)
    for name, ref in want.clipped_sum.items():
        torch.testing.assert_close(
            got[name].double(), ref, rtol=0.0, atol=1e-5 * CLIP, msg=f"{engine_name} {name}"
        )


def assert_refused(model: nn.Module, engine_name: str, pattern: str) -> None:
    """make_engine refuses at once, in one line matching ``pattern``."""
    with pytest.raises(ValueError, match=pattern) as refusal:
        make_engine(engine_name, CLIP, model)
    assert "\n" not in str(refusal.value)


@pytest.mark.parametrize("engine_name", ENGINE_NAMES)
@pytest.mark.parametrize("kind", list(RECURRENT))
def test_a_trainable_recurrent_layer_is_refused_by_every_engine_naming_it_and_the_way_out(
    kind, engine_name
):
    model = Recurrent(RECURRENT[kind]())
    pattern = rf"^layer 'encoder\.rnn' \({kind}\) .*nn\.Linear layers .*engine=vmap.*requires_grad_\(False\)"
    assert_refused(model, engine_name, pattern)
    with pytest.raises(ValueError, match=pattern):
        check_per_example_compatible(model)
    assert supported_engines(model) == []


@pytest.mark.parametrize("kind", list(RECURRENT))
def test_a_frozen_recurrent_layer_is_exact_under_bk_and_refused_by_vmap(kind):
    torch.manual_seed(0)
    model = Recurrent(RECURRENT[kind]())
    model.encoder.requires_grad_(False)
    for engine_name in ("auto", "bk", "ghost"):
        assert_exact(engine_name, model)  # gradients flow through it to `inp`
    assert_refused(
        model,
        "vmap",
        rf"^layer 'encoder\.rnn' \({kind}\) cannot run inside the vmap engine.*engine=bk",
    )
    assert supported_engines(model) == ["auto", "bk", "ghost"]
    # auto falls back to vmap when another layer has no bk rule: refused, saying why it came there
    fallback = Recurrent(RECURRENT[kind](), extra=Scale())
    fallback.encoder.requires_grad_(False)
    assert_refused(
        fallback,
        "auto",
        r"^layer 'encoder\.rnn' .*engine=bk.*\(engine auto -> vmap: bk does not support extra",
    )
    assert supported_engines(fallback) == []


@pytest.mark.parametrize("engine_name", ENGINE_NAMES)
@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("layer", [nn.Embedding, nn.EmbeddingBag])
def test_an_embedding_with_max_norm_is_refused_before_it_writes_the_weight(
    layer, frozen, engine_name
):
    # max_norm renormalises the rows the batch looks up, in place, during the forward pass: frozen
    # or not, the model would carry an un-noised trace of which tokens the private batch held.
    model = Embedded(layer(VOCAB, HIDDEN, max_norm=0.1))
    model.encoder.requires_grad_(not frozen)
    before = model.encoder["embed"].weight.detach().clone()
    assert_refused(
        model,
        engine_name,
        rf"^layer 'encoder\.embed' \({layer.__name__}\) renormalises .*max_norm=None",
    )
    assert torch.equal(model.encoder["embed"].weight, before)


@pytest.mark.parametrize("engine_name", ENGINE_NAMES)
def test_a_trainable_sparse_embedding_is_refused(engine_name):
    model = Embedded(nn.Embedding(VOCAB, HIDDEN, sparse=True))
    assert_refused(
        model,
        engine_name,
        r"^layer 'encoder\.embed' \(Embedding\) has sparse gradients.*sparse=False",
    )
    model.encoder.requires_grad_(False)  # no gradient of its own: nothing sparse to clip
    assert make_engine(engine_name, CLIP, model)[0] is not None


@pytest.mark.parametrize("engine_name", ENGINE_NAMES)
@pytest.mark.parametrize(
    "norm, pattern",
    [
        (
            nn.BatchNorm1d(HIDDEN, affine=False),
            r"'extra' \(BatchNorm1d\) mixes examples.*GroupNorm",
        ),
        (
            nn.InstanceNorm1d(HIDDEN, track_running_stats=True),
            r"'extra' \(InstanceNorm1d\) keeps running statistics",
        ),
    ],
)
def test_batch_mixing_norms_are_refused_by_every_engine_not_only_the_trainer(
    norm, pattern, engine_name
):
    model = Recurrent(RECURRENT["GRU"](), extra=norm)
    model.encoder.requires_grad_(False)
    assert_refused(model, engine_name, pattern)


def test_the_way_out_a_recurrence_of_linear_layers_is_exact_under_vmap():
    torch.manual_seed(1)
    assert_exact("vmap", LinearRecurrence())


def test_make_private_refuses_a_recurrent_layer_when_it_is_made():
    model = Recurrent(RECURRENT["LSTM"]())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"^layer 'encoder\.rnn' \(LSTM\) "):
        dpscale.make_private(
            model,
            optimizer,
            dataset_size=100,
            batch_size=10,
            max_grad_norm=CLIP,
            delta=1e-5,
            noise_multiplier=1.0,
            steps=3,
        )

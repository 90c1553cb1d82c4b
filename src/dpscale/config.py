"""Run configuration: frozen dataclasses loaded from YAML and ``--set key=value`` overrides.

Everything a run does is decided here, once; the resolved config is written to the run
directory so a run can be reproduced (and resumed) from it alone.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dpscale.choices import (
    ACCOUNTANT_KINDS, CLIPPINGS, DEFAULT_MAX_BANDS, PEFT_METHODS, DEFAULT_MAX_NOISE_MEMORY_MB, ENGINE_NAMES, MECHANISMS, PRECISIONS,
)  # fmt: skip
from dpscale.errors import ConfigError
from dpscale.clip_norms import check_max_grad_norm, check_max_grad_norm_per

OPTIMIZERS: tuple[str, ...] = ("sgd", "adam", "adamw")  # optim.name
LR_SCHEDULES: tuple[str, ...] = ("constant", "cosine")  # optim.schedule


def _either(names: tuple[str, ...]) -> str:
    """``("a", "b", "c")`` -> "a, b or c" (how a refusal lists the allowed values)."""
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]


@dataclass(frozen=True)
class DataConfig:
    """Attributes:
    name: dataset name (see ``dpscale.data.DATASET_NAMES``); "mnist-5k" is embedded.
    root: directory (or .npz file) holding the data; unused for "mnist-5k".
    image_size: resize image-folder images to this square size.
    normalize: map [0, 1] pixels to [-1, 1] with the data-independent (0.5, 0.5); statistics
        computed from private data would leak privacy.
    loader: "memory" (decode everything into one tensor), "stream" (read chunks from disk with
        worker processes while training; image folders and prepared shards) or "auto" (memory
        when the decoded training set takes at most a quarter of this machine's memory, else
        stream, with a notice). The sampling, and so the privacy analysis, is the same.
    workers: loader processes for streaming (null: all cores but one).
    prefetch: chunks each streaming worker reads ahead.
    skip_corrupt: leave out (count and report) images that cannot be decoded, checking every
        image before training; N is then the readable images. Default: an unreadable image is an
        error naming the file.
    val_labels: label file of a flat ``root/val`` folder ("<file name> <class>" lines).
    classes: keep only these labels (relabelled 0..k-1 in this order), in training and test.
    random_classes: keep this many labels drawn with ``subset_seed`` (instead of ``classes``).
    meta_classes: group the kept classes into this many evenly sized meta-classes (seeded).
    max_per_class: at most this many training examples per class (a seeded choice).
    subset_seed: the seed of random_classes, meta_classes and max_per_class.
    num_classes: the number of classes K (the model's outputs), declared instead of read from the
        labels; every label must be below it, and training labels with gaps or test labels absent
        from training are then allowed (null: K from the data, and those are refused).
    privacy_unit: who the guarantee protects: "example" (any one training image, the default) or
        "user" (any one person's images, all together: users are sampled, each contributes at most
        dp.max_examples_per_user images per step, clipped as one; N, B and q count users). Needs
        a user id per training image: a ``user_ids`` array in an npz file, a side file
        ``train-user-ids.txt`` (one id per line) / ``.npy`` beside IDX or CIFAR files, or an image
        folder's ``users.csv`` (path,user), kept by ``dpscale data prepare`` (docs/privacy-units.md).
    """

    name: str = "mnist-5k"
    root: str | None = None
    image_size: int | None = None
    normalize: bool = True
    loader: str = "auto"
    workers: int | None = None
    prefetch: int = 2
    skip_corrupt: bool = False
    val_labels: str | None = None
    classes: tuple[int, ...] | None = None
    random_classes: int | None = None
    meta_classes: int | None = None
    max_per_class: int | None = None
    subset_seed: int = 0
    num_classes: int | None = None
    privacy_unit: str = "example"

    @property
    def selects_classes(self) -> bool:
        """Whether a class subset, meta-classes or a per-class cap applies."""
        return self.classes is not None or bool(self.random_classes or self.meta_classes or self.max_per_class)


@dataclass(frozen=True)
class FeaturesConfig:
    """Fixed feature extraction and normalisation in front of the model (Tramer & Boneh 2021).

    Attributes:
        extractor: null (train on pixels), "scatternet" (ScatterNet S(x), no privacy cost: it is
            data-independent), "model:<registry name>" or "checkpoint:<run dir>" (penultimate
            features of a model, e.g. one pre-trained on public data, for a linear probe). When the
            run behind a checkpoint trained on this run's training data (same data fingerprint), its
            whole accounting history is composed into this run's epsilon (and sigma calibrated for it);
            a non-private such run is refused.
        extractor_public: declare the run behind a "checkpoint:" extractor public: its cost is then
            left out of epsilon even on the same training data, and every output says so.
        scatter_j, scatter_angles, scatter_order: ScatterNet scales J, angles L and depth
            (paper: 2, 8, 2 -> 81 channels per image channel at H/4 x W/4).
        scatter_pad: zero pixels added on each side of the image before the ScatterNet
            (paper: 0; 2 turns 28x28 images into 8x8 instead of 7x7 coefficients).
        normalize: "none"; "groupnorm" (per example, G groups, no privacy cost); or "datanorm"
            (private per-channel mean/variance, Tramer Algorithm 2, composed with DP-SGD).
        groups: G for groupnorm.
        norm_clip: [C1, C2], L2 bounds on each example's channel means and mean-squares.
        norm_noise: sigma_norm, the noise multiplier of both datanorm Gaussian sums.
        norm_floor: tau, the smallest variance datanorm divides by.
        center: subtract a private estimate of the training set's mean feature vector after the
            normalisation (one Gaussian sum, the "feature-mean" release, composed with DP-SGD);
            lifts linear heads on GroupNorm-ed ScatterNet features (docs/results.md, issue 28).
        center_clip: L2 bound on each example's normalised feature vector, as a multiple of
            sqrt(number of features) (a root-mean-square per feature); 1.0 is GroupNorm's own
            bound, so with groupnorm no example is clipped.
        center_noise: sigma_center, the noise multiplier of the centring sum.
        cache: reuse features computed by an earlier run (keyed by data and extractor).
        cache_dir: where features are cached (null: $DPSCALE_CACHE_DIR or ~/.cache/dpscale/features).
        batch_size: images per extraction batch.
    """

    extractor: str | None = None
    extractor_public: bool = False
    scatter_j: int = 2
    scatter_angles: int = 8
    scatter_order: int = 2
    scatter_pad: int = 0
    normalize: str = "none"
    groups: int = 27
    norm_clip: tuple[float, float] = (0.3, 0.15)
    norm_noise: float = 8.0
    norm_floor: float = 1e-5
    center: bool = False
    center_clip: float = 1.0
    center_noise: float = 8.0
    cache: bool = True
    cache_dir: str | None = None
    batch_size: int = 512


@dataclass(frozen=True)
class AugmentConfig:
    """Augmentation multiplicity (AugMult; De et al. 2022, TAN eq. 5).

    Attributes:
        multiplicity: K views per training example; an example's loss (hence gradient) is the
            mean over its views, taken before clipping, so the sensitivity stays C and the
            accounting is unchanged. 1 (default): no augmentation.
        type: identity, crop-flip (reflect-pad 4, random crop, horizontal flip), rrc (random
            resized crop, area 8-100%, aspect 3/4-4/3, flip) or simclr (colour jitter, grayscale,
            blur, rrc, flip). Parameters are drawn per view, on the training device, from a
            generator seeded by the run seed and saved in checkpoints.
    """

    multiplicity: int = 1
    type: str = "crop-flip"


@dataclass(frozen=True)
class EvalConfig:
    """Attributes:
    augtest: also report ``test_accuracy_augtest``: a majority vote over ``augment.multiplicity``
        views of each test image drawn with ``augment.type`` (TAN's AugTest; not the headline
        accuracy).
    """

    augtest: bool = False


@dataclass(frozen=True)
class ModelConfig:
    """Attributes:
    name: registry name (``dpscale models`` lists them).
    activation: relu, tanh, or tempered_sigmoid(s=..,T=..,o=..).
    kwargs: builder-specific options, e.g. {filters: [16, 16]}.
    freeze_groups: freeze the first k of the model's block groups (input stem first, logits
        last); only the remaining parameters are trained, clipped and noised.
    init: start from these weights instead of a random init: a run directory (its checkpoint,
        e.g. from ``dpscale pretrain``), a checkpoint or state-dict file, or ``timm:<name>`` where
        timm imports. Matched by name and shape; a mismatch is refused with the list. When a run
        directory's run trained on this run's training data (same data fingerprint), its whole
        accounting history is composed into this run's epsilon (and sigma calibrated for it); a
        non-private such run is refused. On other data, and for any other source, the guarantee
        assumes the source's training data is public (every output says so).
    init_public: declare the run behind model.init public: its cost is then left out of epsilon
        even on the same training data, and every output says so.
    reset_head: with init, keep a freshly initialised logits layer (for another number of classes).
    init_scaling: "none", or "meanvar": every layer drawn from a Gaussian with the mean and variance
        of the same layer of ``init_seed_model`` (Raghu et al. 2019, as Papernot Section 4.2).
    init_seed_model: the run directory of the seed model for meanvar. Its statistics are a release
        about its training data: its run's accounting is composed into this run's epsilon (it must
        be private), unless ``init_seed_public`` declares its training data public.
    init_seed_public: the seed model trained on public data: its cost is left out (every output says so).
    peft: parameter-efficient fine-tuning (docs/transfer.md): "none", "lora" (frozen Linear/Conv2d
        layers get trainable rank-r updates), "bitfit" (biases only) or "last_groups" (the last
        train_last_groups of the model's block groups); the logits layer always trains in full.
    lora_rank: LoRA's r.
    lora_alpha: LoRA's alpha (the update is scaled by alpha / r); null: alpha = r.
    lora_targets: fnmatch patterns over module names that get LoRA adapters (default: all).
    train_last_groups: k for peft=last_groups.
    """

    name: str = "papernot-cnn"
    activation: str = "tanh"
    kwargs: dict[str, Any] = field(default_factory=dict)
    freeze_groups: int = 0
    init: str | None = None
    init_public: bool = False
    reset_head: bool = False
    init_scaling: str = "none"
    init_seed_model: str | None = None
    init_seed_public: bool = False
    peft: str = "none"
    lora_rank: int = 8
    lora_alpha: float | None = None
    lora_targets: tuple[str, ...] = ("*",)
    train_last_groups: int = 1


@dataclass(frozen=True)
class DPConfig:
    """Attributes:
    epsilon: target epsilon; sigma is calibrated to it when noise_multiplier is null, and
        a given noise_multiplier must not exceed it. Null with noise_multiplier=0: non-private.
    delta: target delta (use < 1/N).
    noise_multiplier: sigma; noise std on the clipped-gradient sum is sigma * max_grad_norm.
    max_grad_norm: per-example clipping norm C; or per-layer bounds, a mapping from parameter-name
        patterns (fnmatch, first match wins) to C_g, e.g. {"features.*": 0.5, "*": 1.0}, the noise
        then scaled to sqrt(sum_g C_g^2); null disables clipping (non-private only).
    max_grad_norm_per: "group" (each pattern's tensors clipped together; one C clips the whole
        gradient) or "tensor" (each trainable tensor clipped on its own, Opacus'
        clipping="per_layer"; the plan then gives each tensor, after model.peft, its own C_i and
        the noise is scaled to sqrt(sum_i C_i^2), docs/clipping.md).
    batch_size: expected logical batch size B (q = B / N). With Poisson sampling B need not be an
        integer (``dpscale tan privacy-search`` gives such B to keep eta exact).
    simulated_batch_size: a TAN simulation (Sander et al. 2023, Section 3.4) of this run: train at
        this batch size with sigma scaled by simulated_batch_size / batch_size and the same steps,
        for about that fraction of the compute. The run then carries NO privacy guarantee at
        dp.epsilon; it reports the reference run's epsilon it stands for. Null: a normal run.
    sampling: "poisson" (each example joins each step independently with probability B/N, the
        default), "fixed" (exactly B distinct examples each step, independently; accounted with RDP
        under replace-one adjacency) or "shuffle" (fixed-size batches from a per-epoch permutation,
        accounted without amplification: a far larger epsilon). docs/sampling.md compares them.
    max_batch_size: cap Poisson batches at this many examples (truncated Poisson, accounted with
        the PLD accountant; a cap near B costs much), "auto" (the smallest cap whose epsilon is
        within 1% of the uncapped one), or null (uncapped).
    accountant: "pld" (tightest) or "rdp". Fixed-size batches are accounted with rdp and capped
        Poisson batches with pld whatever this says (the only accountants dp_accounting has for them).
    secure_noise: draw the Gaussian noise (DP-SGD's and Data Normalization's) from the operating
        system's cryptographically secure generator (os.urandom) instead of the seeded 128-bit
        stream: nothing (not run.seed, not the
        checkpoint) can reproduce it; a resumed run continues with fresh noise, so resume is no
        longer bit-identical. Batch sampling stays on the seeded stream.
    mechanism: "dpsgd" (independent noise each step) or "bandmf" (banded matrix factorization:
        correlated noise and cyclic Poisson sampling, docs/correlated_noise.md).
    bands: BandMF's number of bands b, or "auto" (the b with the least expected error x sigma,
        1 = DP-SGD when nothing beats it). Ignored for dpsgd.
    max_bands: the largest b that bands=auto tries.
    max_noise_memory_mb: BandMF keeps the last b-1 noise vectors, (b-1) x parameters x 4 bytes;
        a b that needs more is refused (auto skips it).
    clipping: "fixed" (C = max_grad_norm throughout) or "adaptive" (Andrew et al. 2021: C starts
        at max_grad_norm and follows the clip_quantile of the per-example norms through a noisy
        count released each step, its cost included in sigma; docs/clipping.md) or "automatic" (Bu
        et al. 2023: every per-example gradient scaled by C / (||g|| + clip_gamma), so its norm is
        below C, the sensitivity; the learning rate absorbs C, which needs no search).
    clip_quantile: adaptive: the share of examples to leave unclipped (gamma, in (0, 1)).
    clip_learning_rate: adaptive: eta, C_{t+1} = C_t exp(-eta (released share - gamma)).
    clip_gamma: automatic: gamma of the scale C / (||g|| + gamma) (Bu et al. 2023); small next to
        the per-example norms, so every gradient is scaled to norm ~C.
    clip_count_noise: adaptive: sigma_b, the std of the noise on the unclipped count (examples);
        null: batch_size / 20 (Andrew et al.'s recommendation).
    max_examples_per_user: k, with data.privacy_unit=user (required there): a drawn user
        contributes at most k of its images per step (a fresh random k-subset when it has more).
    """

    epsilon: float | None = 3.0
    delta: float = 1e-5
    noise_multiplier: float | None = None
    max_grad_norm: float | dict[str, float] | None = 1.0
    max_grad_norm_per: str = "group"
    batch_size: int | float = 256
    simulated_batch_size: int | float | None = None
    sampling: str = "poisson"
    max_batch_size: int | str | None = None
    accountant: str = "pld"
    secure_noise: bool = False
    mechanism: str = "dpsgd"
    bands: int | str = "auto"
    max_bands: int = DEFAULT_MAX_BANDS
    max_noise_memory_mb: float = DEFAULT_MAX_NOISE_MEMORY_MB
    clipping: str = "fixed"
    clip_quantile: float = 0.5
    clip_learning_rate: float = 0.2
    clip_count_noise: float | None = None
    clip_gamma: float = 0.01
    max_examples_per_user: int | None = None


@dataclass(frozen=True)
class OptimConfig:
    """Attributes:
    name: sgd, adam or adamw.
    lr: peak learning rate.
    momentum, nesterov, dampening: SGD options.
    weight_decay: L2 (sgd, adam) or decoupled (adamw) decay.
    betas, eps: Adam options.
    schedule: "constant" or "cosine" (linear warmup then cosine decay to min_lr_ratio * lr).
    warmup_steps: linear warmup length (both schedules).
    min_lr_ratio: final lr / peak lr for the cosine schedule.
    """

    name: str = "sgd"
    lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = False
    dampening: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0


@dataclass(frozen=True)
class TrainConfig:
    """Attributes:
    epochs: training length in epochs (steps = round(epochs * N / B)); or give steps.
    steps: training length in logical steps (overrides epochs).
    max_physical_batch_size: most examples processed at once (gradient accumulation).
    engine: per-example clipping engine: auto (bk when every trainable parameter's route is
        supported, else vmap), bk (book-keeping), ghost (Gram-matrix norms + book-keeping sums)
        or vmap.
    self_check: before the first step, compare the engine's per-example norms and clipped sum
        with a per-example loop on a few training examples; refuse on a mismatch (auto falls
        back to vmap). false: skip it, and every output says the engine went unchecked.
    precision: how the model's forward/backward compute: fp32, tf32 (CUDA TF32 matmuls), bf16
        or fp16 (autocast; parameters stay float32). Per-example norms, clip factors, the
        clipped sum and the noise are float32 in every case (docs/precision.md).
    fp16_loss_scale: the fixed loss scale S of fp16 (a power of two; never adapted, since
        adapting to overflows would depend on the private data).
    eval_batch_size: batch size for evaluation.
    eval_every_epochs: evaluate and log every this many epochs (and at the end).
    checkpoint_every_minutes: checkpoint once this many minutes have passed since the last
        checkpoint (checked after every step; null: never by time). Always at the end, when
        stopping early and on Ctrl-C.
    checkpoint_every_steps: also checkpoint every this many steps (null: off).
    ema_decay: keep an exponential moving average of the parameters, updated after every
        logical step (e.g. 0.999); evaluations then also report the EMA model (null: off). It is
        computed from the released (noisy) updates only, so it costs no privacy.
    """

    epochs: float | None = 15.0
    steps: int | None = None
    max_physical_batch_size: int = 512
    engine: str = "auto"
    self_check: bool = True
    precision: str = "fp32"
    fp16_loss_scale: float = 1024.0
    eval_batch_size: int = 1000
    eval_every_epochs: float = 1.0
    checkpoint_every_minutes: float | None = 10.0
    checkpoint_every_steps: int | None = None
    ema_decay: float | None = None


@dataclass(frozen=True)
class RunConfig:
    """Attributes:
    seed: seeds model init, batch sampling and noise (separate streams). null (default): fresh
        OS entropy that is never written down, as the DP analysis assumes the noise is secret.
        A fixed seed makes a run reproducible but lets anyone who knows it replay the noise; every
        output of such a run says so with its epsilon.
    out_dir: run directory for config.yaml, metrics.jsonl, checkpoint.pt, summary.json
        (null: runs/<model>-<data>-<date-time>).
    threads: torch CPU threads (null: torch's default).
    device: "cpu" or "cuda".
    tensorboard: write TensorBoard event files to <out_dir>/tensorboard (train loss, test
        accuracy, epsilon, clipped fraction, mean per-example norm, step time, the config and the
        privacy statement; ``dpscale.train.tensorboard``). Skipped with a note where the
        tensorboard package is not installed.
    """

    seed: int | None = None
    out_dir: str | None = None
    threads: int | None = None
    device: str = "cpu"
    tensorboard: bool = True


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    dp: DPConfig = field(default_factory=DPConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))


def _plain(value: Any) -> Any:
    """Tuples -> lists so YAML stays plain and re-loadable."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class _Override:
    """A ``--set`` value: the text as typed and its YAML reading. String fields take the text
    itself, so paths like ``runs/a #2`` or ``2024`` are not mangled by YAML (comments, numbers)."""

    raw: str
    parsed: Any
    error: str | None = None  # why the text is not valid YAML (fine for a string-typed key)

    def resolve(self, path: str, annotation: Any) -> Any:
        union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
        options = typing.get_args(annotation) if union else (annotation,)
        if str not in options:
            if self.error:
                raise ConfigError(f"{path}: cannot parse value {self.raw!r}: {self.error}")
            return self.parsed
        text = self.raw.strip()
        if text in ("", "null", "~", "Null", "NULL"):
            return None
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
            return self.parsed
        if int in options and isinstance(self.parsed, int) and not isinstance(self.parsed, bool):
            return self.parsed  # a number or a word (dp.bands: 4 or auto): the number, as YAML reads it
        return text


def _unwrap(value: Any) -> Any:
    """Free-form values (model.kwargs) take the YAML reading of any --set inside them."""
    if isinstance(value, _Override):
        return value.parsed
    if isinstance(value, dict):
        return {k: _unwrap(v) for k, v in value.items()}
    return value


def _coerce(path: str, value: Any, annotation: Any) -> Any:
    """Check/convert ``value`` against a (simple) type annotation, with a clear error."""
    if isinstance(value, _Override):
        value = value.resolve(path, annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(f"{path} must not be null")
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(path, value, option)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0])
    if value is None:
        raise ConfigError(f"{path} must not be null")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path} must be true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or int(value) != value:
            raise ConfigError(f"{path} must be an integer, got {value!r}")
        return int(value)
    if annotation is float:
        if isinstance(value, str):
            # PyYAML follows YAML 1.1, which reads 1e-5 (no dot) as a string.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path} must be a number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path} must be a string, got {value!r}")
        return value
    if origin is tuple:
        args = typing.get_args(annotation)
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: any length
            if not isinstance(value, (list, tuple)):
                raise ConfigError(f"{path} must be a list, got {value!r}")
            return tuple(_coerce(f"{path}[{i}]", v, args[0]) for i, v in enumerate(value))
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{path} must be a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(f"{path}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a mapping, got {value!r}")
        return _unwrap(value)
    raise ConfigError(f"{path}: unsupported type {annotation}")  # pragma: no cover


def _build(cls: type, path: str, values: dict[str, Any]) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{path or 'config'} must be a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in values if k not in names]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, names, n=1)
        where = f"{path}.{key}" if path else key
        hint = f" (did you mean {path + '.' if path else ''}{close[0]}?)" if close else ""
        raise ConfigError(f"unknown config key {where!r}{hint}; valid keys: {', '.join(names)}")
    kwargs = {}
    for name in names:
        if name not in values:
            continue
        sub_path = f"{path}.{name}" if path else name
        if dataclasses.is_dataclass(hints[name]):
            section = values[name]
            if isinstance(section, _Override):  # --set dp={epsilon: 2, delta: 1e-6}
                section = section.parsed
            kwargs[name] = _build(hints[name], sub_path, section or {})
        else:
            kwargs[name] = _coerce(sub_path, values[name], hints[name])
    return cls(**kwargs)


def _yaml_problem(err: yaml.YAMLError, text: str, in_file: bool) -> tuple[str | None, str, str]:
    """Where and what PyYAML found wrong, for a one-line message.

    PyYAML's own ``str(err)`` spans 4-8 lines (an excerpt with a caret, "<unicode string>" as
    the file name), which breaks the one-line error contract of the command line.

    Args:
        err: the error ``yaml.safe_load(text)`` raised.
        text: the text it was reading.
        in_file: positions as compilers write them after a file name (``line:column``); else, for
            a one-line ``--set`` value, ``column C`` (``line L, column C`` past its first line).

    Returns:
        (position, problem, context): the position is None when PyYAML gives none; the context
        says what PyYAML was parsing and where that started, in parentheses ("" if it does not).
    """

    def at(line: int, column: int) -> str:  # 0-based in, 1-based out
        if in_file:
            return f"{line + 1}:{column + 1}"
        return f"column {column + 1}" if line == 0 else f"line {line + 1}, column {column + 1}"

    if isinstance(err, yaml.reader.ReaderError):  # a character offset, no line/column mark
        offset = min(err.position, len(text))
        character = f" (#x{err.character:04x})" if isinstance(err.character, int) else ""
        start = text.rfind("\n", 0, offset) + 1
        return at(text.count("\n", 0, offset), offset - start), f"{err.reason}{character}", ""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    what, context_mark = getattr(err, "context", None), getattr(err, "context_mark", None)
    context = f" ({what} at {at(context_mark.line, context_mark.column)})" if what and context_mark else ""
    return (at(mark.line, mark.column) if mark else None), problem, context


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``a.b.c=value``; the value is read as YAML (numbers, null, lists, mappings), except
    that string-typed keys take the text as typed.

    Args:
        text: one ``--set`` argument.

    Returns:
        (keys, value): the dotted key split into its parts, and the value to merge (an
        ``_Override`` keeping the text as typed, its YAML reading and, when the text is not
        valid YAML, why, in one line).

    Raises:
        ConfigError: no ``=`` or an empty key.
    """
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects key=value, got {text!r}")
    try:
        return key.strip().split("."), _Override(raw, yaml.safe_load(raw) if raw.strip() else None)
    except yaml.YAMLError as err:  # only acceptable for a string-typed key; checked when built
        position, problem, context = _yaml_problem(err, raw, in_file=False)
        where = f" at {position}" if position else ""
        return key.strip().split("."), _Override(raw, raw, f"{problem}{where}{context}")


def _merge(base: dict[str, Any], keys: list[str], value: Any) -> None:
    node = base
    for key in keys[:-1]:
        child = node.get(key)
        if isinstance(child, _Override) and isinstance(child.parsed, dict):
            child = node[key] = dict(child.parsed)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {'.'.join(keys)}: {key} is not a section")
        node = child
    node[keys[-1]] = value


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: PyYAML keeps the last one
    silently, so a second ``epsilon:`` further down a file would override the first unseen."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    first_line: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *base" may override what it merges in
            continue
        key = loader.construct_object(key_node, deep=deep)
        try:
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"duplicate key {key!r} (first given on line {first_line[key] + 1})", key_node.start_mark,
                )  # fmt: skip
            first_line[key] = key_node.start_mark.line
        except TypeError:  # an unhashable key: SafeLoader's own error follows
            break
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def _read_config_file(path: Path) -> dict[str, Any]:
    """The sections of a YAML config file; every problem is one line naming the file (and, for
    malformed YAML, ``file:line:column``, as compilers write it).

    Args:
        path: the YAML file.

    Returns:
        Its mapping of sections ({} for an empty file).

    Raises:
        ConfigError: missing, unreadable, not UTF-8, not valid YAML, or not a mapping.
    """
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {err.start}: {err.reason})") from err
    except OSError as err:
        raise ConfigError(f"config file {path} cannot be read: {err.strerror or err}") from err
    try:
        values = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as err:
        position, problem, context = _yaml_problem(err, text, in_file=True)
        where = f"{path}:{position}" if position else str(path)
        raise ConfigError(f"config file {where}: not valid YAML: {problem}{context}") from err
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections")
    return values


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults <- YAML file <- ``--set`` overrides, validated.

    Args:
        path: YAML file with sections data, features, augment, model, dp, optim, train, run,
            eval (any may be omitted), or "preset:<name>" (``dpscale presets`` lists them).
        overrides: "section.key=value" strings, applied in order.

    Raises:
        ConfigError: unreadable file, unknown key, wrong type or out-of-range value.
    """
    values: dict[str, Any] = {}
    if isinstance(path, str) and path.startswith("preset:"):
        from dpscale.presets import get_preset  # local: presets are plain data, loaded on demand

        try:
            values = get_preset(path).values
        except KeyError as err:
            raise ConfigError(err.args[0]) from err
    elif path is not None:
        values = _read_config_file(Path(path))
    for text in overrides:
        keys, value = parse_override(text)
        _merge(values, keys, value)
    config = _build(Config, "", values)
    validate(config)
    return config


def is_private_config(dp: DPConfig) -> bool:
    """Whether the DP section describes a private run (sigma calibrated, or given and > 0)."""
    return dp.noise_multiplier is None or dp.noise_multiplier > 0


def plan_labels(config: Config) -> dict[str, bool]:
    """The DP plan's labels a config determines (``dpscale.privacy.plan.PLAN_LABELS`` but the
    source runs, which are checked against their own directories): a fixed seed, the engine's
    self-check off, noise from the OS CSPRNG."""
    return {
        "seeded": config.run.seed is not None,
        "engine_unchecked": not config.train.self_check,
        "secure_noise": config.dp.secure_noise,
    }


def _check_max_grad_norm_per(dp: DPConfig) -> None:
    """Refuse a dp.max_grad_norm_per that is not "group" or "tensor", and "tensor" without a norm
    or with adaptive clipping (the run's plan spells "tensor" out per tensor once the model is
    built: train/plan_config.py)."""
    try:
        check_max_grad_norm_per(dp.max_grad_norm_per, dp.max_grad_norm)
    except ValueError as err:
        raise ConfigError(f"dp.{err}") from err
    if dp.max_grad_norm_per == "tensor" and dp.clipping == "adaptive":
        raise ConfigError(
            "adaptive clipping (dp.clipping=adaptive) moves one norm C on the whole gradient; "
            "not with dp.max_grad_norm_per=tensor (a bound per tensor): use dp.max_grad_norm_per=group"
        )


def validate(config: Config) -> None:
    """Range checks that need no data; dataset-dependent checks happen in the trainer."""
    dp, train, optim = config.dp, config.train, config.optim
    if dp.epsilon is not None and not (dp.epsilon > 0 and math.isfinite(dp.epsilon)):
        raise ConfigError(f"dp.epsilon must be a positive finite number, got {dp.epsilon}")
    if not 0 < dp.delta < 1:
        raise ConfigError(f"dp.delta must be in (0, 1), got {dp.delta}")
    if dp.noise_multiplier is not None and not (dp.noise_multiplier >= 0 and math.isfinite(dp.noise_multiplier)):
        raise ConfigError(f"dp.noise_multiplier must be >= 0, got {dp.noise_multiplier}")
    if dp.epsilon is None and dp.noise_multiplier is None:
        raise ConfigError("set dp.epsilon (sigma is then calibrated) or dp.noise_multiplier (0 for a non-private run)")
    try:
        check_max_grad_norm(dp.max_grad_norm)
    except ValueError as err:
        raise ConfigError(f"dp.{err} (or null for no clipping)") from err
    _check_max_grad_norm_per(dp)
    is_private = is_private_config(dp)
    if is_private and dp.max_grad_norm is None:
        raise ConfigError("a private run needs clipping: set dp.max_grad_norm (null is for non-private runs only)")
    if dp.noise_multiplier == 0 and dp.epsilon is not None:
        raise ConfigError(
            "dp.noise_multiplier=0 is a non-private run and cannot meet dp.epsilon; set dp.epsilon=null to train without privacy"
        )
    if not (dp.batch_size >= 1 and math.isfinite(dp.batch_size)):
        raise ConfigError(f"dp.batch_size must be >= 1, got {dp.batch_size}")
    from dpscale.data.sampling import SAMPLING_MODES  # local, as for AUGMENTATIONS: one list, where it is used

    if dp.sampling not in SAMPLING_MODES:
        raise ConfigError(f"dp.sampling must be {_either(SAMPLING_MODES)}, got {dp.sampling!r}")
    if dp.sampling in ("fixed", "shuffle") and not isinstance(dp.batch_size, int):
        raise ConfigError(f"dp.sampling={dp.sampling} needs an integer dp.batch_size, got {dp.batch_size}")
    if dp.simulated_batch_size is not None:
        if not (1 <= dp.simulated_batch_size and math.isfinite(dp.simulated_batch_size)):
            raise ConfigError(f"dp.simulated_batch_size must be >= 1 or null, got {dp.simulated_batch_size}")
        if not is_private_config(dp):
            raise ConfigError("dp.simulated_batch_size simulates a private run: it needs dp.noise_multiplier > 0 or null")
        if dp.sampling == "shuffle" and not isinstance(dp.simulated_batch_size, int):
            raise ConfigError(f"dp.sampling=shuffle needs an integer dp.simulated_batch_size, got {dp.simulated_batch_size}")
    if dp.accountant not in ACCOUNTANT_KINDS:
        raise ConfigError(f"dp.accountant must be {_either(ACCOUNTANT_KINDS)}, got {dp.accountant!r}")
    _validate_mechanism(dp)
    if dp.clipping not in CLIPPINGS:
        raise ConfigError(f"dp.clipping must be {_either(CLIPPINGS)}, got {dp.clipping!r}")
    if train.steps is None and train.epochs is None:
        raise ConfigError("set train.epochs or train.steps")
    if train.steps is not None and train.steps < 1:
        raise ConfigError(f"train.steps must be >= 1, got {train.steps}")
    if train.steps is None and not (train.epochs > 0 and math.isfinite(train.epochs)):
        raise ConfigError(f"train.epochs must be a positive finite number, got {train.epochs}")
    if train.max_physical_batch_size < 1:
        raise ConfigError(f"train.max_physical_batch_size must be >= 1, got {train.max_physical_batch_size}")
    if not train.eval_every_epochs > 0:
        raise ConfigError(f"train.eval_every_epochs must be > 0, got {train.eval_every_epochs}")
    from dpscale.privacy.precision import Precision  # local: keep config import-light

    if train.precision not in PRECISIONS:
        raise ConfigError(f"train.precision must be one of {', '.join(PRECISIONS)}, got {train.precision!r}")
    try:
        Precision("fp16", train.fp16_loss_scale)
    except ValueError as err:
        raise ConfigError(f"train.fp16_loss_scale: {err}") from err
    if train.engine not in ENGINE_NAMES:
        raise ConfigError(f"train.engine must be {_either(ENGINE_NAMES)}, got {train.engine!r}")
    if train.eval_batch_size < 1:
        raise ConfigError(f"train.eval_batch_size must be >= 1, got {train.eval_batch_size}")
    if train.checkpoint_every_minutes is not None and not train.checkpoint_every_minutes > 0:
        raise ConfigError(f"train.checkpoint_every_minutes must be > 0 or null, got {train.checkpoint_every_minutes}")
    if train.checkpoint_every_steps is not None and train.checkpoint_every_steps < 1:
        raise ConfigError(f"train.checkpoint_every_steps must be >= 1 or null, got {train.checkpoint_every_steps}")
    run = config.run
    if run.threads is not None and run.threads < 1:
        raise ConfigError(f"run.threads must be >= 1 or null, got {run.threads}")
    if not re.fullmatch(r"cpu|cuda(:\d+)?|mps", run.device):
        raise ConfigError(f"run.device must be cpu, cuda, cuda:N or mps, got {run.device!r}")
    if run.seed is not None and run.seed < 0:
        raise ConfigError(f"run.seed must be >= 0 or null, got {run.seed}")
    if optim.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name must be {_either(OPTIMIZERS)}, got {optim.name!r}")
    if not optim.lr > 0:
        raise ConfigError(f"optim.lr must be > 0, got {optim.lr}")
    if optim.schedule not in LR_SCHEDULES:
        raise ConfigError(f"optim.schedule must be {_either(LR_SCHEDULES)}, got {optim.schedule!r}")
    if optim.nesterov and (optim.momentum <= 0 or optim.dampening != 0):
        raise ConfigError("optim.nesterov needs optim.momentum > 0 and optim.dampening = 0")
    if optim.warmup_steps < 0 or not 0 <= optim.min_lr_ratio <= 1:
        raise ConfigError("optim.warmup_steps must be >= 0 and optim.min_lr_ratio in [0, 1]")
    _validate_features(config.features, is_private)
    _validate_data(config)
    _validate_model(config)
    if train.ema_decay is not None and not 0 < train.ema_decay < 1:
        raise ConfigError(f"train.ema_decay must be in (0, 1) or null, got {train.ema_decay}")
    augment = config.augment
    from dpscale.data.augment import AUGMENTATIONS  # local: keep config import-light; one list of names

    if augment.multiplicity < 1:
        raise ConfigError(f"augment.multiplicity must be >= 1, got {augment.multiplicity}")
    if augment.type not in AUGMENTATIONS:
        raise ConfigError(f"augment.type must be one of {', '.join(AUGMENTATIONS)}, got {augment.type!r}")
    if augment.multiplicity > 1 and config.features.extractor is not None:
        raise ConfigError("augment.multiplicity > 1 augments images; it cannot be combined with features.extractor")
    if config.eval.augtest and augment.multiplicity < 2:
        raise ConfigError("eval.augtest votes over augment.multiplicity views: set augment.multiplicity >= 2")


def _validate_mechanism(dp: DPConfig) -> None:
    """dp.mechanism and BandMF's settings (what needs the data, such as b*q <= 1, is checked with the plan)."""
    if dp.mechanism not in MECHANISMS:
        raise ConfigError(f"dp.mechanism must be {_either(MECHANISMS)}, got {dp.mechanism!r}")
    if dp.bands != "auto" and (not isinstance(dp.bands, int) or dp.bands < 1):
        raise ConfigError(f"dp.bands must be auto or an integer >= 1, got {dp.bands!r}")
    if dp.max_bands < 1 or not dp.max_noise_memory_mb > 0:
        raise ConfigError("dp.max_bands must be >= 1 and dp.max_noise_memory_mb > 0")
    if dp.mechanism == "bandmf":
        from dpscale.privacy.correlated import check_bandmf_settings  # local: keep config import-light; one text

        check_bandmf_settings(
            sampling=dp.sampling, simulated=dp.simulated_batch_size is not None,
            noise_multiplier=dp.noise_multiplier, bands=dp.bands,
        )  # fmt: skip


FEATURE_EXTRACTORS = ("scatternet", "model:<registry name>", "checkpoint:<run dir>")


DATA_LOADERS = ("auto", "memory", "stream")


def _validate_model(config: Config) -> None:
    model = config.model
    if model.reset_head and model.init is None:
        raise ConfigError("model.reset_head re-initialises the head of weights loaded with model.init; set model.init")
    if model.init_public and model.init is None:
        raise ConfigError("model.init_public declares the run behind model.init public; set model.init")
    if model.init_scaling not in ("none", "meanvar"):
        raise ConfigError(f"model.init_scaling must be none or meanvar, got {model.init_scaling!r}")
    if model.init_scaling == "meanvar" and (model.init_seed_model is None or model.init is not None):
        raise ConfigError("model.init_scaling=meanvar needs model.init_seed_model (a run directory) and no model.init")
    if model.init_scaling == "none" and (model.init_seed_model is not None or model.init_seed_public):
        raise ConfigError("model.init_seed_model / init_seed_public are for model.init_scaling=meanvar")
    if model.freeze_groups < 0:
        raise ConfigError(f"model.freeze_groups must be >= 0, got {model.freeze_groups}")
    if model.peft not in PEFT_METHODS:
        raise ConfigError(f"model.peft must be {_either(PEFT_METHODS)}, got {model.peft!r}")
    if model.peft != "none" and model.freeze_groups:
        raise ConfigError("model.peft chooses what trains; do not set model.freeze_groups with it")
    if model.lora_rank < 1 or model.train_last_groups < 1:
        raise ConfigError("model.lora_rank and model.train_last_groups must be >= 1")


def _validate_data(config: Config) -> None:
    data = config.data
    _validate_privacy_unit(config)
    if data.loader not in DATA_LOADERS:
        raise ConfigError(f"data.loader must be one of {', '.join(DATA_LOADERS)}, got {data.loader!r}")
    if data.workers is not None and data.workers < 0:
        raise ConfigError(f"data.workers must be >= 0 (0: read in the training process), got {data.workers}")
    if data.prefetch < 1:
        raise ConfigError(f"data.prefetch must be >= 1, got {data.prefetch}")
    if data.classes is not None and data.random_classes:
        raise ConfigError("set data.classes or data.random_classes, not both")
    if data.max_per_class is not None and data.max_per_class < 1:
        raise ConfigError(f"data.max_per_class must be >= 1, got {data.max_per_class}")
    if data.num_classes is not None and data.num_classes < 2:
        raise ConfigError(f"data.num_classes must be >= 2 (a classifier needs at least two classes), got {data.num_classes}")
    if data.num_classes is not None and (data.classes is not None or data.random_classes or data.meta_classes):
        raise ConfigError(
            "data.num_classes declares the stored labels; data.classes, random_classes and meta_classes "
            "choose classes and relabel them 0..k-1: set one or the other"
        )
    if data.loader == "stream" and data.selects_classes:
        raise ConfigError("class subsets (data.classes, random_classes, meta_classes, max_per_class) need data.loader=memory")
    if data.loader == "stream":
        if data.name not in ("imagefolder", "shards"):
            raise ConfigError(
                f"data.loader=stream reads image folders and prepared shards (data.name imagefolder or shards), not {data.name!r}"
            )
        if config.features.extractor is not None or config.features.normalize != "none" or config.features.center:
            raise ConfigError(
                "data.loader=stream feeds pixels to the model; features.extractor, features.normalize and "
                "features.center need data.loader=memory"
            )
        if config.eval.augtest:
            raise ConfigError("eval.augtest is not available with data.loader=stream yet; use data.loader=memory")


def _validate_privacy_unit(config: Config) -> None:
    """The unit's settings, checked where a plan checks them (one place for the rule)."""
    from dpscale.privacy.group_privacy import check_privacy_unit  # torch-free

    check_privacy_unit(config.data.privacy_unit, config.dp.max_examples_per_user, sampling=config.dp.sampling,
                       simulated=config.dp.simulated_batch_size is not None)  # fmt: skip


def _validate_features(features: FeaturesConfig, is_private: bool) -> None:
    extractor = features.extractor
    if extractor is not None and not (
        extractor == "scatternet"
        or (extractor.startswith("model:") and len(extractor) > 6)
        or (extractor.startswith("checkpoint:") and len(extractor) > 11)
    ):
        raise ConfigError(f"features.extractor must be null or one of {', '.join(FEATURE_EXTRACTORS)}, got {extractor!r}")
    if features.extractor_public and not (extractor or "").startswith("checkpoint:"):
        # Only a trained run can have spent privacy; anything else declared public is a mistake.
        raise ConfigError(
            f"features.extractor_public declares the run behind a checkpoint:<run dir> extractor public; "
            f"features.extractor is {extractor!r}"
        )
    if features.scatter_j < 1 or features.scatter_angles < 1 or features.scatter_order not in (1, 2):
        raise ConfigError("features.scatter_j and scatter_angles must be >= 1 and scatter_order 1 or 2")
    if features.scatter_pad < 0:
        raise ConfigError(f"features.scatter_pad must be >= 0 (pixels per side), got {features.scatter_pad}")
    from dpscale.features.normalize import NORMALIZATIONS  # local, as for AUGMENTATIONS

    if features.normalize not in NORMALIZATIONS:
        raise ConfigError(f"features.normalize must be one of {', '.join(NORMALIZATIONS)}, got {features.normalize!r}")
    if features.groups < 1:
        raise ConfigError(f"features.groups must be >= 1, got {features.groups}")
    if not all(c > 0 and math.isfinite(c) for c in features.norm_clip):
        raise ConfigError(f"features.norm_clip must be two positive numbers [C1, C2], got {list(features.norm_clip)}")
    if not (features.norm_noise >= 0 and math.isfinite(features.norm_noise)):
        raise ConfigError(f"features.norm_noise must be >= 0, got {features.norm_noise}")
    if not features.norm_floor > 0:
        raise ConfigError(f"features.norm_floor must be > 0, got {features.norm_floor}")
    if features.batch_size < 1:
        raise ConfigError(f"features.batch_size must be >= 1, got {features.batch_size}")
    if is_private and features.normalize == "datanorm" and features.norm_noise == 0:
        raise ConfigError(
            "features.normalize=datanorm with features.norm_noise=0 releases exact statistics of the private "
            "data; set norm_noise > 0 (the paper uses 6 or 8) or use normalize=groupnorm"
        )
    _validate_centring(features, is_private)


def _validate_centring(features: FeaturesConfig, is_private: bool) -> None:
    if not (features.center_clip > 0 and math.isfinite(features.center_clip)):
        raise ConfigError(f"features.center_clip must be a positive number, got {features.center_clip}")
    if not (features.center_noise >= 0 and math.isfinite(features.center_noise)):
        raise ConfigError(f"features.center_noise must be >= 0, got {features.center_noise}")
    if is_private and features.center and features.center_noise == 0:
        raise ConfigError(
            "features.center with features.center_noise=0 subtracts the exact mean of the private data; "
            "set center_noise > 0 (dpscale's presets use 8)"
        )


def config_yaml(config: Config) -> str:
    """The resolved config as the YAML text of a run's config.yaml."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)


def save_config(config: Config, path: Path) -> None:
    """Write the resolved config as YAML (atomically)."""
    from dpscale._io import atomic_write_text

    atomic_write_text(path, config_yaml(config))

"""The run configuration's schema: the frozen dataclass sections of a config, every key, its default
and its meaning. It imports neither the loader nor the checks: the config's modules import one way,
schema <- validation <- load, and the package's names (``from dpscale.config import ...``) come from them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dpscale.choices import DEFAULT_MAX_BANDS, DEFAULT_MAX_NOISE_MEMORY_MB


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
    max_per_class: at most this many training examples per class (a seeded choice). Which
        images of a class stay depends on the others, so a private run with it says that its
        guarantee covers the selected training set (header, summary.json, model card); to choose
        unit by unit, subset the data by a rule of each image alone before dpscale reads it.
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
        return self.classes is not None or bool(
            self.random_classes or self.meta_classes or self.max_per_class
        )


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
        type: identity, crop-flip (reflect-pad ``padding``, random crop, horizontal flip), crop
            (the same without the flip: translations of up to ``padding`` px only), rrc (random
            resized crop, area 8-100%, aspect 3/4-4/3, flip) or simclr (colour jitter, grayscale,
            blur, rrc, flip). Parameters are drawn per view, on the training device, from a
            generator seeded by the run seed and saved in checkpoints.
        padding: crop-flip's and crop's reflect padding, px (the largest shift; 4: TAN's for
            32 x 32 CIFAR-10).
    """

    multiplicity: int = 1
    type: str = "crop-flip"
    padding: int = 4


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
    max_batch_size: cap Poisson batches at this many examples (users at data.privacy_unit=user;
        a larger draw keeps a uniformly random subset of that size; truncated Poisson, accounted with
        the PLD accountant; a cap near B costs much), "auto" (the smallest cap whose epsilon is
        within 1% of the uncapped one, at least B), or null (uncapped).
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
    max_physical_batch_size: most examples processed at once (gradient accumulation; with
        AugMult's K views, rows: examples x K), or "auto": the largest chunk whose measured peak
        fits memory_budget_mb, measured once per machine and model and cached (a multiple of 8,
        or the largest logical batch; dpscale.train.chunk_size, docs/performance.md). The run's
        config.yaml records the number chosen, so a resumed run chunks (and adds up) as before.
    memory_budget_mb: the memory max_physical_batch_size=auto may fill, MB (null: 90% of the
        GPU's free memory on CUDA, half the available RAM on a CPU); unused with a number.
    engine: per-example clipping engine: auto (bk when every trainable parameter's route is
        supported, else vmap), bk (book-keeping), ghost (Gram-matrix norms + book-keeping sums)
        or vmap.
    compile: capture each chunk's clipped sum (forward, backward, norms, clipping, the sum) with
        torch.compile: the vmap engine's arithmetic, checked eagerly first; engine auto or vmap,
        precision fp32; each new chunk size compiles again (docs/engines.md, "The compiled step").
    fixed_shapes: pad every chunk with zero rows, which weigh exactly nothing, to one size (the
        chunk, or the cap or fixed batch size when smaller), so every step has one shape; null:
        with compile (not at the user unit). The release and epsilon are the unpadded run's.
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
        computed from the released (noisy) updates only, so it costs no privacy. Its warm-up
        min(d, (1 + t) / (10 + t)) sets the decay until step (10 d - 1) / (1 - d) (8,990 for
        0.999): a shorter run averages about its last tenth of steps whatever d is (the run says so).
    """

    epochs: float | None = 15.0
    steps: int | None = None
    max_physical_batch_size: int | str = 512
    memory_budget_mb: float | None = None
    engine: str = "auto"
    compile: bool = False
    fixed_shapes: bool | None = None
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

"""The fixed wording of what a DP plan's guarantee does not cover: its caveats, printed with every epsilon."""

NOT_PRIVATE = "NOT PRIVATE: noise_multiplier=0 (non-private baseline), no DP guarantee"
GUARANTEE_SCOPE = (
    "epsilon covers the trained model (and anything computed from it alone). Not covered: the "
    "train_loss/gradient-norm statistics in metrics.jsonl, the TensorBoard events and the progress bar "
    "(computed on private examples without noise), the RNG states in checkpoint.pt, and hyper-parameter tuning on the same "
    "data. Keep the run directory private; release the model (dpscale export)."
)
# A fixed run.seed is a caveat of its own (DPPlan.seeded), printed with every epsilon of such a run.
SEEDED_CAVEAT = (
    "run.seed is fixed: anyone who knows it (and the code) can replay the batch sampling and the noise, "
    "which the guarantee assumes secret; use a seed for research, not for a model you release"
)
SEEDED_SECURE_NOISE_CAVEAT = (
    "run.seed is fixed: anyone who knows it (and the code) can replay the batch sampling, which the guarantee "
    "assumes secret (the noise of DP-SGD and of Data Normalization comes from the OS CSPRNG, dp.secure_noise, "
    "and cannot be replayed)"
)
# train.self_check=false: the clipping engine was not compared with a per-example loop (DPPlan.engine_unchecked).
ENGINE_UNCHECKED_CAVEAT = (
    "checks off (train.self_check=false, make_private(check=False)): neither was the per-example clipping engine "
    "checked against a per-example loop on this model, nor the model and loss for batch independence, so a gradient "
    "route the engine misses, or a layer or loss that mixes examples, would go unnoticed (docs/privacy.md)"
)

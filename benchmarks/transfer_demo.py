"""Transfer demonstration: MNIST (public) -> Fashion-MNIST (private), at several epsilons and seeds:
from scratch; initialised from a non-private MNIST model (new head) with the convolutions frozen or
all layers fine-tuned, or fine-tuned parameter-efficiently (LoRA, BiTFiT, a linear probe of the
logits layer); and Mean-Var init from a private Fashion-MNIST seed run whose epsilon (0.25) is
composed into the run's budget:

    python benchmarks/transfer_demo.py --mnist ../shared/data/mnist-10k --fmnist ../shared/data/fashion-mnist \\
        [--epsilons 1,3] [--seeds 0,1,2] [--epochs 10] [--variants scratch,init,...] [--out /tmp/transfer-demo]

Every run is a ``dpscale`` command (printed). Prints a markdown table of mean +- std test
accuracy per (epsilon, variant) and each run's accuracy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

MODEL = ["model.name=papernot-cnn", "dp.batch_size=512", "train.max_physical_batch_size=512", "optim.momentum=0.9"]
PRIVATE = [*MODEL, "optim.lr=2.0", "dp.max_grad_norm=0.1", "dp.accountant=rdp"]  # Tramer's C=0.1 recipe, lr x B/2048
PUBLIC = [*MODEL, "optim.lr=0.05"]  # non-private pretraining: no clipping, an ordinary lr


def dpscale(args: list[str]) -> None:
    command = [sys.executable, "-m", "dpscale", *args]
    print("$ dpscale " + " ".join(args), flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def sets(overrides: list[str]) -> list[str]:
    return sum((["--set", o] for o in overrides), [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mnist", required=True)
    parser.add_argument("--fmnist", required=True)
    parser.add_argument("--epsilons", default="1,3")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=float, default=10)
    parser.add_argument("--out", default="/tmp/transfer-demo")
    parser.add_argument("--variants", default="", help="comma list of scratch, init, init-all, meanvar, lora, bitfit, "
                        "probe (default: all)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    source = out / "mnist-pretrained"
    if not (source / "summary.json").exists():
        dpscale(["pretrain", "--quiet", *sets([*PUBLIC, "data.name=mnist", f"data.root={args.mnist}", "train.epochs=5",
                                               "run.seed=0", f"run.out_dir={source}"])])  # fmt: skip
    seed_run = out / "fmnist-meanvar-seed"  # private, on the private data: its cost is composed into each epsilon
    if not (seed_run / "summary.json").exists():
        dpscale(["train", "--quiet", *sets([*PRIVATE, "data.name=fashion-mnist", f"data.root={args.fmnist}",
                                            "dp.epsilon=0.25", "train.epochs=2", "run.seed=0", f"run.out_dir={seed_run}"])])  # fmt: skip
    init = [f"model.init={source}", "model.reset_head=true"]
    variants = {
        "from scratch": [],
        "MNIST init, convs frozen": [*init, "model.freeze_groups=2"],
        "MNIST init, all fine-tuned": init,
        "Mean-Var from a private FMNIST seed (eps 0.25 of the budget)": ["model.init_scaling=meanvar",
                                                                        f"model.init_seed_model={seed_run}"],
    }  # fmt: skip
    variants.update({
        "MNIST init, LoRA r=4 (alpha 8) + new head": [*init, "model.peft=lora", "model.lora_rank=4", "model.lora_alpha=8"],
        "MNIST init, BiTFiT (biases) + new head": [*init, "model.peft=bitfit"],
        "MNIST init, linear probe (new head only)": [*init, "model.peft=last_groups", "model.train_last_groups=1"],
    })  # fmt: skip
    tags = dict(zip(variants, ("scratch", "init", "init-all", "meanvar", "lora", "bitfit", "probe")))
    chosen = args.variants.split(",") if args.variants else list(tags.values())
    variants = {name: extra for name, extra in variants.items() if tags[name] in chosen}
    results: dict[tuple[str, str], list[float]] = {}
    for eps in args.epsilons.split(","):
        for name, extra in variants.items():
            for seed in args.seeds.split(","):
                run = out / f"eps{eps}-{tags[name]}-seed{seed}"
                if not (run / "summary.json").exists():
                    dpscale(["train", "--quiet", *sets([*PRIVATE, *extra, "data.name=fashion-mnist", f"data.root={args.fmnist}",
                                                        f"dp.epsilon={eps}", f"train.epochs={args.epochs}", f"run.seed={seed}",
                                                        f"run.out_dir={run}"])])  # fmt: skip
                summary = json.loads((run / "summary.json").read_text())
                results.setdefault((eps, name), []).append(
                    (summary["test_accuracy"], summary["trainable_params"], summary["wall_time_s"] / summary["steps"])
                )  # fmt: skip
    print("\n| epsilon | variant | trainable parameters | test accuracy, mean +- std | runs | ms per step (run wall time / steps) |")
    print("|---|---|---|---|---|---|")
    for (eps, name), rows in results.items():
        accs = [a for a, _, _ in rows]
        spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
        runs = ", ".join(f"{100 * a:.2f}" for a in accs)
        ms = statistics.median(1000 * t for _, _, t in rows)
        print(f"| {eps} | {name} | {rows[0][1]:,} | {100 * statistics.mean(accs):.2f} +- {100 * spread:.2f}% | {runs} | {ms:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

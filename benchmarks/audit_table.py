"""The audit table of docs/audit.md: honest runs of the default embedded-MNIST config at
epsilon 1, 3 and 8 (three seeds each, gradient and input canaries), and deliberately broken runs
(noise drawn at 0.05x its std; clipping letting 10x through) that still claim their epsilon.

    python benchmarks/audit_table.py [--out DIR] [--canaries M] [--seeds 0,1,2]

Prints a markdown table (one row per run) and writes it with the raw results to DIR.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dpscale.audit.run import AuditFault, run_audit
from dpscale.config import load_config

FAULTS = {"honest": None, "noise x0.05": AuditFault(noise_scale=0.05), "clip x10": AuditFault(clip_scale=10.0)}


def one(out: Path, name: str, epsilon: float, seed: int, kind: str, canaries: int, fault: str) -> dict:
    config = load_config(None, [f"run.out_dir={out / name}", f"dp.epsilon={epsilon}", f"run.seed={seed}", "train.checkpoint_every_minutes=null"])
    start = time.perf_counter()
    result = run_audit(config, kind=kind, canaries=canaries, progress=False, plot=seed == 0, fault=FAULTS[fault])
    row = {**result.as_json(), "fault": fault, "seed": seed, "wall_s": time.perf_counter() - start}
    print(f"| {fault} | {kind} | {canaries} | {epsilon:g} | {seed} | {row['epsilon']:.3f} | {row['eps_lower_bound']:.3f} | {row['eps_ceiling']:.2f} | "
          f"{row['correct']}/{row['guesses']} | {100 * row['test_accuracy']:.1f}% | {'PASS' if row['passed'] else 'FAIL'} | {row['wall_s']:.0f} |", flush=True)  # fmt: skip
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/audit-table")
    parser.add_argument("--canaries", type=int, default=1000)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--big-canaries", type=int, default=20000, help="gradient canaries for refuting epsilon 8")
    args = parser.parse_args()
    out = Path(args.out)
    seeds = [int(s) for s in args.seeds.split(",")]
    print("| run | canaries | m | target eps | seed | claimed eps | eps lower bound (95%) | ceiling | right/guesses | test acc | verdict | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for kind in ("gradient", "input"):
        for epsilon in (1.0, 3.0, 8.0):
            for seed in seeds:
                rows.append(one(out, f"{kind}-honest-e{epsilon:g}-s{seed}", epsilon, seed, kind, args.canaries, "honest"))
    for fault in ("noise x0.05", "clip x10"):
        for epsilon in (1.0, 3.0, 8.0):
            m = args.big_canaries if epsilon == 8.0 else args.canaries
            tag = fault.replace(" ", "").replace(".", "")
            rows.append(one(out, f"gradient-{tag}-e{epsilon:g}", epsilon, 0, "gradient", m, fault))
        rows.append(one(out, f"input-{fault.replace(' ', '').replace('.', '')}-e1", 1.0, 0, "input", args.canaries, fault))
    (out / "audit_table.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()

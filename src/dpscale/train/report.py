"""What a run reports: the evaluation records of metrics.jsonl and the summary.json of a
finished run (privacy fields first: what was spent, by which plan, what it does not cover)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpscale._io import VERSION_KEY, atomic_write_text
from dpscale._version import __version__
from dpscale.cpu_memory import trim_kept_memory
from dpscale.data.stream import eval_batches
from dpscale.data.run_data import data_workers
from dpscale.data.splits import selection_note
from dpscale.models import count_parameters
from dpscale.config import Config
from dpscale.privacy.clipping.autotune import layer_methods
from dpscale.privacy.accounting.tradeoff import NO_ODDS, attacker_odds
from dpscale.privacy.accounting.group_privacy import unit_text
from dpscale.privacy.plan.dp_plan import DPPlan
from dpscale.privacy.plan.caveat_texts import GUARANTEE_SCOPE
from dpscale.runs import SUMMARY_NAME
from dpscale.train.distributed import NOISE_RANK
from dpscale.train.build import Log, Run
from dpscale.train.metrics import evaluate, evaluate_augtest, evaluate_batches, json_safe
from dpscale.train.people_line import people_line
from dpscale.train.progress import Progress, epochs_done


def format_epsilon(epsilon: float) -> str:
    return "inf" if not math.isfinite(epsilon) else f"{epsilon:.3f}"


def evaluate_model(built: Run, model: nn.Module) -> tuple[float, float]:
    """Accuracy and mean loss of ``model`` on the test set (streamed from disk when training is),
    on a trimmed kept heap: its batches, sized unlike a step's, would not fit the step's freed
    blocks and would stay on top of them (``dpscale.cpu_memory``)."""
    trim_kept_memory()
    try:
        return _evaluate_model(built, model)
    finally:
        trim_kept_memory()


def _evaluate_model(built: Run, model: nn.Module) -> tuple[float, float]:
    """``evaluate_model``'s evaluation itself."""
    config = built.config
    batch = config.train.eval_batch_size
    if built.streamed:  # host memory bounded by the training chunk, whatever eval_batch_size says
        batch = min(batch, built.physical_batch_size)
        return evaluate_batches(
            model, eval_batches(built.data, batch, built.device, data_workers(config)), built.device
        )
    return evaluate(model, built.data.x_test, built.data.y_test, batch)


def extra_evaluations(built: Run, augtest_seed: int) -> dict[str, float]:
    """EMA-model and AugTest accuracies, when configured (not the headline test_accuracy);
    ``augtest_seed`` seeds AugTest's views."""
    out: dict[str, float] = {}
    if built.ema is not None:
        out["test_accuracy_ema"], out["test_loss_ema"] = evaluate_model(built, built.ema.model)
    augment = built.config.augment
    if built.config.eval.augtest:  # in memory only (config validation)
        generator = torch.Generator().manual_seed(augtest_seed)
        out["test_accuracy_augtest"] = evaluate_augtest(
            built.model,
            built.data.x_test,
            built.data.y_test,
            augment.type,
            augment.multiplicity,
            generator,
            built.value_range,
            built.config.train.eval_batch_size,
            augment.padding,
        )
    return out


def evaluation_record(
    built: Run, progress: Progress, window: dict[str, Any], log: Log
) -> dict[str, Any]:
    """One line of metrics.jsonl: test accuracy and loss, epsilon so far, the train-loss window
    (``window``: loss sum, examples, non-finite examples since the last evaluation); ``log``
    prints the warning about non-finite examples."""
    plan, step = built.plan, progress.step
    accuracy, test_loss = evaluate_model(built, built.model)
    record = {
        "epoch": epochs_done(plan, step),
        "step": step,
        "train_loss": window["loss_sum"] / window["examples"] if window["examples"] else None,
        "test_accuracy": accuracy,
        "test_loss": test_loss,
        "epsilon": built.mechanism.epsilon(),
        "delta": plan.delta,
        **({"reference_epsilon": plan.reference_epsilon(step)} if plan.simulation else {}),
        **(
            {"clip_norm": built.mechanism.clip} if plan.adaptive is not None else {}
        ),  # C_t, adaptive clipping
        # epsilon's unit when it is a person (the example unit's records stay as they were);
        # train_loss is then per user, the sum of its images' losses
        **({"privacy_unit": "user"} if plan.user_level else {}),
        "lr": built.scheduler.get_last_lr()[0],
        "wall_time_s": progress.wall_time_s,
    }
    if window["nonfinite_examples"]:  # they contributed zero; say so, it is a utility loss
        record["nonfinite_examples"] = window["nonfinite_examples"]
        log(
            f"WARNING: {window['nonfinite_examples']} examples since the last evaluation had non-finite gradients "
            "and contributed zero (fp16 overflow? lower train.fp16_loss_scale or use bf16)"
        )
    record.update(extra_evaluations(built, progress.augtest_seed))
    odds = odds_summary(built)["tpr_at_fpr"] if step else None  # ms: the epsilon's PLD is cached
    if odds is not None:
        record["tpr_at_fpr"] = odds  # the best membership test's TPR at FPR 0.1/1/10% so far
    if plan.caveats():
        record["privacy_note"] = "; ".join(plan.caveats())
    return record


def evaluation_line(record: dict[str, Any]) -> str:
    """The run report's line of an evaluation record (``evaluation_record``'s)."""
    return (
        f"epoch {record['epoch']:.2f} step {record['step']}: test accuracy "
        f"{100 * record['test_accuracy']:.2f}%, epsilon {format_epsilon(record['epsilon'])}"
    )


def privacy_statement(
    plan: DPPlan, privacy_warnings: list[str], training_set: str | None = None
) -> list[str]:
    """The lines a run prints before training (and TensorBoard keeps): the plan, what it means,
    the planned attacker's odds, and every caveat and warning (``privacy_advice``'s; and
    ``training_set``, :func:`training_set_note`'s)."""
    lines = [plan.describe(), *filter(None, [plan.meaning(), plan.planned_odds()])]
    return lines + [
        f"WARNING: {note}" for note in plan.caveats() + privacy_warnings + [training_set] if note
    ]


def training_set_note(built: Run) -> str | None:
    """What a private run says when rules of the whole collection chose its training set (a split
    by index, data.max_per_class): its guarantee covers the selected set (None: nothing to say)."""
    return selection_note(built.data.info.selected_by) if built.plan.is_private else None


def header_lines(plan: DPPlan, built: Run, privacy_warnings: list[str]) -> list[str]:
    """Every line of a session's run header: the privacy statement (with how the training set was
    chosen) and, where the data names people, the people line."""
    people = people_line(plan, getattr(built.data, "user_ids", None))
    return privacy_statement(plan, privacy_warnings, training_set_note(built)) + (
        [people] if people else []
    )


def privacy_advice(plan: DPPlan, config: Config) -> list[str]:
    """Advice about the privacy parameters: the privacy wall, and Mean-Var statistics declared public."""
    warning = plan.wall_warning()
    advice = [warning] if warning else []
    model = config.model  # model.init's source: in the plan's caveats (plan.init_run)
    if model.init_scaling == "meanvar" and model.init_seed_public:
        advice.append(
            f"model.init_seed_public: the Mean-Var statistics of {model.init_seed_model} are left out of "
            "epsilon (its training data declared public)"
        )
    return advice


def privacy_summary(built: Run, progress: Progress, privacy_warnings: list[str]) -> dict[str, Any]:
    """The summary's privacy fields: what was spent, by which plan, and what it does not cover
    (``privacy_warnings``: the run's advice, ``privacy_advice``)."""
    return {
        **_spent(built, progress.step),
        **_caveats(built, progress, privacy_warnings),
        **odds_summary(built),
    }


def _spent(built: Run, step: int) -> dict[str, Any]:
    """The summary's privacy fields of what was spent and by which plan, after ``step`` steps."""
    plan = built.plan
    return {
        "epsilon": built.mechanism.epsilon(),
        "delta": plan.delta,
        "target_epsilon": plan.target_epsilon,
        # a TAN simulation is no private model: its guarantee is not the one it reports
        "private": plan.is_private and plan.simulation is None,
        "noise_multiplier": plan.noise_multiplier,
        "noise_calibrated": plan.calibrated,
        "max_grad_norm": plan.max_grad_norm,
        "clipping": "adaptive"
        if plan.adaptive is not None
        else "automatic"
        if plan.clip_gamma
        else "fixed",
        "clip_gamma": plan.clip_gamma,
        "clip_norm": built.mechanism.clip,  # the last step's C (adaptive clipping moves it)
        # the unit the guarantee protects: at "user", N, B and q count users (each at most k examples a step)
        "privacy_unit": plan.privacy_unit,
        "max_examples_per_user": plan.max_examples_per_user,
        "protects": unit_text(plan.privacy_unit),
        "batch_size": plan.batch_size,
        "sample_rate": plan.sample_rate,
        "dataset_size": plan.dataset_size,
        "steps": step,
        "epochs": epochs_done(plan, step),
        "sampling": plan.sampling_text,  # what ran: "cyclic poisson" for BandMF with b > 1
        "max_batch_size": plan.max_batch_size,  # the cap that ran (units a step: users at the user unit), or null
        "adjacency": plan.adjacency,
        "accountant": plan.accountant,
        "mechanism": plan.mechanism,
        # BandMF: b, why, its strategy and amplified accounting (ceil(S/b) compositions at p = b*q)
        "bandmf": (
            {
                **asdict(plan.correlated),
                "participation_rate": plan.participation_rate,
                "compositions": plan.compositions(step),
            }
            if plan.correlated
            else None
        ),
        "eps_tan": plan.eps_tan,
        "epsilon_parts": built.mechanism.accountant.epsilon_by_label(plan.delta)
        if plan.releases
        else None,
    }


def _caveats(built: Run, progress: Progress, privacy_warnings: list[str]) -> dict[str, Any]:
    """The summary's privacy fields of what the guarantee does not cover: a simulation, the run's
    advice, the features and how they entered epsilon, the caveats, the training set, the seed and
    the changes asked for on resume."""
    plan, step = built.plan, progress.step
    return {
        "simulation": (
            {**asdict(plan.simulation), "own_epsilon_accountant": plan.run_accountant}
            if plan.simulation
            else None
        ),
        "reference_epsilon": plan.reference_epsilon(step) if plan.simulation else None,
        "privacy_warnings": privacy_warnings,
        "features": built.config.features.extractor,
        "feature_normalization": built.feature_normalizer.kind,
        # a released mean subtracted
        "feature_centering": built.feature_normalizer.center is not None,
        # composed / declared public / other data: how a checkpoint extractor's run enters epsilon
        "extractor_privacy": plan.extractor.case if plan.extractor else None,
        "guarantee_caveats": plan.caveats(),
        "guarantee_scope": GUARANTEE_SCOPE if plan.is_private else None,
        # chosen from the whole collection: what the guarantee covers
        "training_set": training_set_note(built),
        "seeded": built.config.run.seed is not None,
        "config_changes": progress.config_changes,  # asked for with --set on resume, by step
    }


def odds_summary(built: Run) -> dict[str, Any]:
    """The guarantee as an attacker's odds (``dpscale.privacy.accounting.tradeoff``), from the run's own
    accountant; none where the printed epsilon is not a guarantee of this run's sampling (a TAN
    simulation: its accounting is of another run)."""
    plan = built.plan
    if not plan.is_private or plan.simulation is not None:
        return dict(NO_ODDS)
    return attacker_odds(
        built.mechanism.accountant, "person" if plan.privacy_unit == "user" else "image"
    )


def new_clip_methods(built: Run) -> str | None:
    """The per-layer norm methods the engine's tuner chose since last asked, as a report line,
    each with where it came from: timed now (under load: not cached), the disk cache (the date and
    load it was timed under) or the checkpoint (``autotune.describe_methods``'s line); again when a
    later chunk's check drops a cached choice. None: nothing new; after a session's first step, as
    the header is printed before the first chunk is timed."""
    tuner = getattr(built.engine, "tuner", None)
    return tuner.unreported() if tuner is not None else None


def write_summary(
    built: Run, progress: Progress, run_dir: Path, last: dict[str, Any], privacy_warnings: list[str]
) -> dict[str, Any]:
    """summary.json of a finished run in ``run_dir`` (rank 0), returned.

    Args:
        built, progress: the run and where it stands (its last step taken).
        last: the last evaluation record (metrics.jsonl's last line).
        privacy_warnings: the run's advice (``privacy_advice``).
    """
    config = built.config
    summary: dict[str, Any] = {
        "test_accuracy": last["test_accuracy"],
        "test_loss": last["test_loss"],
        **{k: last[k] for k in ("test_accuracy_ema", "test_accuracy_augtest") if k in last},
        "augment_multiplicity": config.augment.multiplicity,
        **privacy_summary(built, progress, privacy_warnings),
        "dataset": built.data.info.name,
        "data_loader": "stream" if built.streamed else "memory",
        "skipped_files": len(built.data.info.skipped_files),
        # streaming, this session: time the step waited for the loader's chunks (s)
        "data_wait_s": progress.data_wait_s if built.streamed else None,
        "model": config.model.name,
        "model_init": built.init_report,
        "trainable_params": count_parameters(built.model, trainable_only=True),
        "engine": built.engine.name,
        "precision": built.precision.name,
        "engine_self_check": built.self_check.as_json() if built.self_check else None,
        "clip_methods": layer_methods(
            built.engine
        ),  # per layer (how chosen and the timings: the log)
        "world_size": built.dist.world_size,
        "noise_rank": NOISE_RANK if built.dist.enabled else None,
        "wall_time_s": progress.wall_time_s,
        VERSION_KEY: __version__,
    }
    summary["privacy_status"] = built.plan.status(summary["epsilon"], summary["reference_epsilon"])
    summary = json_safe(summary)
    atomic_write_text(run_dir / SUMMARY_NAME, json.dumps(summary, indent=2) + "\n")
    return summary

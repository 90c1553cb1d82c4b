"""The run a ``checkpoint:`` extractor or ``model.init`` starts from: what its training spent and
how that enters this run's guarantee.

A model trained on this run's training data carries that data's privacy cost into what this run takes
from it: :func:`read_source_run` gives the DP plan what that run spent, and :func:`source_run_privacy`
decides how it enters the guarantee (composed, other data, or declared public).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from dpscale._io import load_checkpoint
from dpscale.config import plan_labels
from dpscale.errors import ConfigError
from dpscale.privacy.accounting.accountant import PrivacyAccountant
from dpscale.privacy.accounting.segments import AccountingSegment
from dpscale.privacy.plan.dp_plan import DPPlan
from dpscale.privacy.plan.source_runs import SOURCE_ROLES, SourceRunPrivacy
from dpscale.runs import CHECKPOINT_NAME, NotARunDirectory, read_run_config


def read_run(
    where: str, check_config: Callable[[Any, Path], None] | None = None
) -> tuple[Path, Path, Any, dict[str, Any]]:
    """The run directory, checkpoint path, config and checkpoint state of ``checkpoint:<where>``;
    ``check_config`` may refuse the run from its config before the checkpoint is read.

    Args:
        where: the run directory or its checkpoint.pt.
        check_config: called with (config, run directory) before the checkpoint is read.

    Returns:
        (run directory, checkpoint path, config, checkpoint state).

    Raises:
        ValueError: not a run directory, or no checkpoint.
    """
    path = Path(where).expanduser()
    # The checkpoint named, not the newest intact one: a source run is read as it stands.
    run_dir, ckpt = (path, path / CHECKPOINT_NAME) if path.is_dir() else (path.parent, path)
    try:
        config = read_run_config(run_dir)
    # a user error (ConfigError, a ValueError too): one line, no traceback
    except NotARunDirectory as err:
        raise ConfigError(f"checkpoint:{where}: {err}") from err
    if check_config is not None:
        check_config(config, run_dir)
    try:
        state = load_checkpoint(ckpt)
    except FileNotFoundError as err:  # a bad spec, like every other: ConfigError (a ValueError too)
        raise ConfigError(str(err)) from err
    return run_dir, ckpt, config, state


@dataclass(frozen=True)
class SourceRun:
    """What the run behind a ``checkpoint:`` extractor did with its training data.

    Attributes:
        run_dir: its run directory.
        data_fingerprint: ``dpscale.data.dataset_fingerprint`` of its training images as it
            prepared them (None if its checkpoint has none).
        data_normalize: its data.normalize, under which that fingerprint was taken.
        private: whether it trained with noise (noise multiplier > 0).
        history: its accountant's whole history: its DP-SGD segments and its own releases.
        caveats: what its own guarantee did not cover (``DPPlan.caveats`` of its plan).
        privacy_unit: the unit its accounting is about ("example", or "user": then one image of a
            person is not an add/remove-one event of its history, see ``refuse_user_level_history``).
    """

    run_dir: Path
    data_fingerprint: str | None
    data_normalize: bool
    private: bool
    history: tuple[AccountingSegment, ...]
    caveats: tuple[str, ...] = ()
    privacy_unit: str = "example"


def read_source_run(where: str) -> SourceRun:
    """The privacy-relevant record of the run that ``checkpoint:<where>`` names (its checkpoint's
    data fingerprint, DP plan and accountant history), for the DP plan of a run on its features.

    Args:
        where: the run directory or its checkpoint.pt, as in ``checkpoint:<where>``.

    Returns:
        The source run's record.

    Raises:
        ValueError: not a run directory, no checkpoint, or one without a DP plan and accountant.
    """
    run_dir, ckpt, config, state = read_run(where)
    # load_checkpoint gives every format in the current layout
    mechanism = state.get("mechanism") or {}
    plan, accountant = mechanism.get("plan"), mechanism.get("accountant")
    if (
        not isinstance(plan, dict)
        or "noise_multiplier" not in plan
        or not isinstance(accountant, dict)
    ):
        raise ConfigError(
            f"{ckpt} holds no DP plan and accountant history: cannot tell what its training cost"
        )
    return SourceRun(
        run_dir=run_dir,
        data_fingerprint=state.get("data_fingerprint"),
        data_normalize=bool(config.data.normalize),
        private=float(plan["noise_multiplier"]) > 0,
        history=PrivacyAccountant.from_state_dict(accountant).history,
        caveats=_source_caveats(plan, config),
        privacy_unit=plan.get("privacy_unit", "example"),  # plans before issue 43: per image
    )


def refuse_user_level_history(run: SourceRun, key: str, source: str, public_key: str) -> None:
    """Refuse to compose a user-level run's history into another run's epsilon: per image it is not
    the add/remove-one event the accountant composes (removing one of a person's images moves a
    user-level release by up to 2C: a replace-one event), and composing it into a per-person
    epsilon would need the same grouping of people, which nothing checks.

    Raises:
        ConfigError: ``run`` is user-level.
    """
    if run.privacy_unit == "user":
        raise ConfigError(
            f"{key}={source!r}: the run in {run.run_dir} was accounted per person (data.privacy_unit=user), which "
            f"dpscale cannot compose into this run's epsilon; set {public_key}=true if its data is public, or train "
            "the source at the example unit"
        )


def source_run_privacy(
    role: str,
    source: str,
    where: str,
    public: bool,
    fingerprint_as: Callable[[bool], str],
    private: bool = True,
) -> tuple[SourceRunPrivacy, tuple[AccountingSegment, ...]]:
    """How a run this run starts from (``role`` "extractor" or "init") enters its guarantee, and
    the releases of that run's training that the DP plan must compose.

    A model trained on this run's training data carries that data's privacy cost into what this
    run takes from it, so its run's whole accounting history (DP-SGD steps and its own releases)
    is composed, relabelled "<prefix>:<label>" (``SOURCE_ROLES``), unless ``public`` declares it
    public. Runs are matched by data fingerprint only: an overlapping subset counts as other data.

    Args:
        role: a key of ``SOURCE_ROLES``.
        source: what the config names (for messages and the plan's label).
        where: the run directory or its checkpoint.pt.
        public: the role's public key (e.g. model.init_public) is set.
        fingerprint_as: this run's training-set fingerprint as prepared with data.normalize set
            to the given flag, so that the source's own convention is compared like for like.
        private: whether this run is private (only then is a non-private source refused).

    Returns:
        The case that applies and the releases to compose (empty unless "composed").

    Raises:
        ConfigError: the source run cannot be read, or it trained on this run's data without
            noise and is not declared public (its release has no finite epsilon).
    """
    words = SOURCE_ROLES[role]
    try:
        run = read_source_run(where)
    except ValueError as err:
        raise ConfigError(f"{words.key}={source!r}: {err}") from err
    # No fingerprint (never written by dpscale so far): assume the same data, the safe side.
    if run.data_fingerprint is not None and run.data_fingerprint != fingerprint_as(
        run.data_normalize
    ):
        return SourceRunPrivacy(source, "other data", role=role), ()
    if public:
        return SourceRunPrivacy(source, "declared public", role=role), ()
    if private and not run.private:
        raise ConfigError(
            f"{words.key}={source!r}: the run in {run.run_dir} trained on this run's training data (same data "
            f"fingerprint) without noise (dp.noise_multiplier=0), so {words.product} have no finite epsilon and "
            f"neither would this run; set {words.public_key}=true to declare that run public (its cost is then "
            f"left out, and every output says so), or {words.alternative}"
        )
    refuse_user_level_history(run, words.key, source, words.public_key)
    releases = tuple(replace(seg, label=f"{words.prefix}:{seg.label}") for seg in run.history)
    return SourceRunPrivacy(source, "composed", run.caveats, role=role), releases


def _source_caveats(plan: dict[str, Any], config: Any) -> tuple[str, ...]:
    """The source plan's caveats, its labels taken from its config (older checkpoints lack them)."""
    # the labels replace the plan's own
    return tuple(DPPlan(**{**plan, **plan_labels(config)}).caveats())

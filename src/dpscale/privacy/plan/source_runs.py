"""How a run this run starts from (a checkpoint feature extractor, a model.init source) enters its guarantee.

The roles of such source runs (the words every text about them uses) and ``SourceRunPrivacy``, the
case that applies to one of them, which the DP plan (``dpscale.privacy.plan.dp_plan``) carries as a label.
"""

from __future__ import annotations

from dataclasses import dataclass

# Label prefixes of the releases that stand for a source run's own history ("extractor-run:dp-sgd").
EXTRACTOR_RUN = "extractor-run"
INIT_RUN = "init-run"
# How a source run enters the guarantee; "assumed public" is a model.init source that is no dpscale
# run directory (a weights file, timm:<name>), whose data and cost cannot be read.
SOURCE_CASES = ("composed", "declared public", "other data", "assumed public")
EXTRACTOR_CASES = SOURCE_CASES[:3]


@dataclass(frozen=True)
class SourceRole:
    """What a source run is to this run: the words every text about it uses.

    Attributes:
        key: the config key that names it; public_key: the key that declares it public.
        prefix: label prefix of its releases in this run's plan.
        noun: how texts name it ("the extractor run"); gives: what this run takes from it.
        product: what of it would have no finite epsilon if it trained without noise.
        alternative: the way out besides declaring it public.
    """

    key: str
    public_key: str
    prefix: str
    noun: str
    gives: str
    product: str
    alternative: str


SOURCE_ROLES = {
    "extractor": SourceRole(
        "features.extractor",
        "features.extractor_public",
        EXTRACTOR_RUN,
        "the extractor run",
        "features from",
        "features from its model",
        "use another extractor",
    ),
    "init": SourceRole(
        "model.init",
        "model.init_public",
        INIT_RUN,
        "the init run",
        "initial weights from",
        "weights from it",
        "start from a run on public data",
    ),
}


@dataclass(frozen=True)
class SourceRunPrivacy:
    """How a run this run starts from (a ``checkpoint:`` feature extractor, a ``model.init``
    source) enters this run's guarantee.

    Attributes:
        source: what the config names, e.g. "checkpoint:<run dir>" or the model.init run directory.
        case: "composed" (it trained on this run's training data: its whole accounting history
            is composed into the plan's releases), "declared public" (same data, but the role's
            public key says its cost is not to be counted), "other data" (its data fingerprint
            differs: nothing composed) or "assumed public" (model.init only: no dpscale run
            directory, nothing can be checked).
        source_caveats: what the source run's own guarantee did not cover (its fixed seed, an
            unchecked engine, ...): when its cost is composed, this run's guarantee inherits them.
        role: "extractor" or "init" (``SOURCE_ROLES``); checkpoints from before "init" lack it.
    """

    source: str
    case: str
    source_caveats: tuple[str, ...] = ()
    role: str = "extractor"

    def __post_init__(self) -> None:
        cases = EXTRACTOR_CASES if self.role == "extractor" else SOURCE_CASES
        if self.role not in SOURCE_ROLES or self.case not in cases:
            raise ValueError(
                f"source run privacy: role {self.role!r} with case {self.case!r} (cases: {cases})"
            )
        # a list when read back
        object.__setattr__(self, "source_caveats", tuple(self.source_caveats))

    @property
    def words(self) -> SourceRole:
        """The role's words (config keys, label prefix, how texts name it)."""
        return SOURCE_ROLES[self.role]

    def describe(self) -> str:
        """One clause for the plan's header: which case applies."""
        if self.case == "composed":
            return (
                f"{self.words.gives} {self.source}, trained on this run's training data (same data fingerprint): "
                f"its privacy cost is composed ({self.words.prefix}:* releases)"
            )
        return self._case_caveat()

    def caveats(self) -> list[str]:
        """Everything the guarantee does not cover because of the source: the case's own
        caveat, or (composed) the source run's caveats, each naming the source."""
        if self.case == "composed":
            return [
                f"{self.words.noun} {self.source} (its cost is composed): {note}"
                for note in self.source_caveats
            ]
        return [self._case_caveat()]

    def _case_caveat(self) -> str:
        """``caveat()`` of a case that is not "composed": each of them has one."""
        caveat = self.caveat()
        # __post_init__ admits only worded cases
        assert caveat is not None, f"no caveat for case {self.case!r}"
        return caveat

    def caveat(self) -> str | None:
        """What the guarantee does not cover because of the source's case (None when composed)."""
        words = self.words
        if self.case == "declared public":
            return (
                f"{words.public_key}: {words.noun} {self.source} trained on this run's training "
                "data (same data fingerprint) and is declared public: its cost is not included in epsilon"
            )
        if self.case == "other data":
            return (
                f"{words.noun} {self.source} trained on other data (its data fingerprint differs): its cost "
                "is not included in epsilon, which assumes that data shares no example with this run's "
                "(an overlapping subset is not detected)"
            )
        if self.case == "assumed public":
            return (
                f"{words.key}: the guarantee assumes the training data of the initial weights ({self.source}) is "
                "public (not a dpscale run directory, so its data and privacy cost cannot be checked)"
            )
        return None

"""The step-time benchmark's row names: their suffixes read apart (-lora, -userK, -compiled) and twin rows added."""

from __future__ import annotations

from dpscale.choices import PEFT_METHODS


def peft_of(engine: str) -> tuple[str, str]:
    """ "dpscale-auto-lora" -> ("dpscale-auto", "lora"): a PEFT suffix (``--peft``); "none" without one."""
    head, _, last = engine.rpartition("-")
    return (head, last) if head and last in PEFT_METHODS and last != "none" else (engine, "none")


def user_rows_of(engine: str) -> tuple[str, int]:
    """ "dpscale-bk-user4" -> ("dpscale-bk", 4): a "-userK" suffix times users of K images (0 without one)."""
    head, _, last = engine.rpartition("-")
    if head and last.startswith("user") and last[4:].isdigit() and int(last[4:]) >= 1:
        return head, int(last[4:])
    return engine, 0


def compiled_of(engine: str) -> tuple[str, bool]:
    """ "dpscale-auto-compiled" -> ("dpscale-auto", True): a "-compiled" suffix (``--compile``) asks
    for the compiled step; it is the last suffix of a name."""
    head, _, last = engine.rpartition("-")
    return (head, True) if head and last == "compiled" else (engine, False)


def with_twin_rows(engines: list[str], suffix: str) -> list[str]:
    """``engines`` with a twin ``ENGINE-suffix`` after each dpscale engine, timed in the same
    process, interleaved, so that their ratio is the suffix's cost (or saving)."""
    out = []
    for engine in engines:
        out.append(engine)
        if engine.startswith("dpscale-") and not engine.endswith(f"-{suffix}"):
            out.append(f"{engine}-{suffix}")
    return out


def with_bandmf_rows(engines: list[str], bands: int) -> list[str]:
    """``engines`` with a BandMF twin after each dpscale engine (``--mechanism bandmf``): both
    timed in one process, interleaved, so their ratio is the cost of the correlated noise."""
    out = []
    for engine in engines:
        out.append(engine)
        if engine.startswith("dpscale-") and "-bandmf" not in engine:
            out.append(f"{engine}-bandmf{bands}")
    return out

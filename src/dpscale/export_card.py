"""The card beside each ``dpscale export`` file: the model, its privacy statement and how to load it, in Markdown."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def partial_note(metadata: dict[str, Any]) -> str | None:
    """ "partial: step S of T" for an export of a run short of its planned steps, else None.

    Args:
        metadata: an export's metadata.

    Returns:
        The note (the card's and the command's), or None for a finished run's export.
    """
    if not metadata.get("partial"):
        return None
    when = (
        "while the run was still training"
        if metadata["exported_while_training"]
        else "after the run stopped"
    )
    return (
        f"partial: step {metadata['step']} of {metadata['planned_steps']} (exported with --allow-partial "
        f"{when}; accuracy and epsilon are those of step {metadata['step']})"
    )


def model_card(metadata: dict[str, Any], path: Path) -> str:
    """The card of one exported file: what the model is, how it was trained privately, how to load it.

    Args:
        metadata: the file's metadata.
        path: the file (the card names it).

    Returns:
        Markdown.
    """
    privacy, model, data = metadata["privacy"], metadata["model"], metadata["data"]
    # nested under their bullet
    caveats = "\n".join(f"  - {c}" for c in privacy.get("guarantee_caveats") or []) or "  - none"
    partial = partial_note(metadata)
    partial_block = f"\n**{partial}**\n" if partial else ""
    return f"""# {model["name"]} on {data["name"]} ({metadata["weights"]} weights)

File: `{path.name}` ({metadata["format"]}), the {metadata["weights"]} weights at step {metadata["step"]} of {metadata["planned_steps"]},
exported by dpscale {metadata["dpscale_version"]}. This card describes that file only.
{partial_block}
## Model
- {model["name"]}, {model["parameters"]:,} parameters, {model["num_classes"]} classes, input {metadata["input"]["shape"]}
  (float32 images in [0, 1], NCHW; normalisation: {metadata["input"]["normalization"]}).{_features_line(metadata)}
- Classes (output i is class i): {_classes_line(metadata["classes"])}
- Test accuracy {100 * metadata["test_accuracy"]:.2f}% on {data["name"]}'s test split ({data["test_split"]}, {data["num_test"]} images).

## Privacy
- **{privacy["privacy_status"]}**
- (epsilon, delta) = ({privacy["epsilon"]}, {privacy["delta"]}), {privacy["accountant"]} accountant, {privacy["sampling"]} sampling, {privacy.get("adjacency", "add/remove")} adjacency
  (q = {privacy["sample_rate"]}, expected batch {privacy["batch_size"]} of N = {privacy["dataset_size"]}{_unit_words(privacy)}),
  noise multiplier {privacy["noise_multiplier"]}, clipping norm {privacy["max_grad_norm"]} ({privacy["clipping"]}),
  {privacy["steps"]} steps, mechanism {privacy["mechanism"]}.
- Who it protects: {privacy.get("protects", "any one training image")} (privacy unit: {privacy.get("privacy_unit", "example")}).{_odds_line(privacy)}
- What the guarantee covers: {privacy.get("guarantee_scope") or "nothing (not a private run)"}{_training_set_line(privacy)}
- Caveats of this run:
{caveats}

## Loading
{_loading_line(metadata, path.name)}
"""


def _training_set_line(privacy: dict[str, Any]) -> str:
    """The card's line when rules of the whole collection chose the training set (report.training_set_note)."""
    return (
        f"\n- **Training set: {privacy['training_set']}.**" if privacy.get("training_set") else ""
    )


def _odds_line(privacy: dict[str, Any]) -> str:
    """The card's reading of the guarantee as an attacker's odds (absent where the run reports none)."""
    if not privacy.get("odds"):
        return ""
    from dpscale.privacy.accounting.tradeoff import format_odds

    return f"\n- As an attacker's odds: {privacy['odds']}; {format_odds(privacy)} [from {privacy['odds_from']}]."


CARD_CLASSES = 20  # a card lists this many class names; the metadata holds them all


def _classes_line(classes: list[str]) -> str:
    """The card's class names: the first ``CARD_CLASSES``, then how many more the metadata holds."""
    listed = ", ".join(f"`{c}`" for c in classes[:CARD_CLASSES])
    more = len(classes) - CARD_CLASSES
    return listed + (f", ... ({more} more in the metadata's `classes`)" if more > 0 else "")


def _features_line(metadata: dict[str, Any]) -> str:
    spec = metadata.get("features")
    if not spec:
        return ""
    return (
        f"\n- Inside the model, before {metadata['model']['name']}: ScatterNet (J={spec['J']}, L={spec['L']}, "
        f"order {spec['max_order']}, pad {spec['pad']}) to {metadata['model']['input_shape']} features, then "
        f"{spec['normalize']}"
        + (
            " (its statistics: a private release, counted in epsilon)"
            if spec["normalize"] == "datanorm"
            else ""
        )
        + (
            ", then minus the training set's mean feature vector (a private release, counted in epsilon)."
            if spec.get("center")
            else "."
        )
    )


def _loading_line(metadata: dict[str, Any], name: str) -> str:
    """The card's loading line; its evaluation call names the data root wherever the dataset needs one
    (an export names no local path: the card once gave a call that failed for an image folder)."""
    data, where = metadata["data"], ""
    if data["name"] != "mnist-5k":
        where += f', data_root="<where {data["name"]} lies on this machine>"'
    if data.get("val_labels"):
        where += f', val_labels="<your copy of {data["val_labels"]}>"'
    return _LOADING[metadata["format"]].format(name=name, where=where)


_LOADING = {
    "safetensors": '`model, meta = dpscale.exported.load_exported("{name}")` rebuilds the zoo model (needs dpscale\'s '
    'models and safetensors); `dpscale.exported.evaluate_exported("{name}"{where})` gives its test accuracy.',
    "torchscript": '`torch.jit.load("{name}")` (torch alone); the metadata: '
    '`torch.jit.load("{name}", _extra_files={{"dpscale.json": ""}})` or `dpscale.exported.read_metadata`.',
    "onnx": '`onnxruntime.InferenceSession("{name}")`, input `images`, output `logits`; the metadata is the '
    "model's `metadata_props` entry `dpscale` (`dpscale.exported.read_metadata`).",
}


def _unit_words(privacy: dict[str, Any]) -> str:
    """ " users, at most k images each per step" when N counts users (the card's batch line)."""
    if privacy.get("privacy_unit") != "user":
        return ""
    return f" users, at most {privacy['max_examples_per_user']} images each per step"

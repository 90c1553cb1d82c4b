"""The layout of a training checkpoint, and ``migrate`` from every earlier layout.

Format 2 (this one)::

    step, wall_time_s, world_size        where the run is (logical steps, seconds, processes P)
    mechanism                            DPMechanism.state_dict(): plan, steps_taken, rank 0's
                                         sampler, noise generator (seeded runs), accountant
    rank_streams                         [{sampler, augment_generator}] of each of the P ranks
    fresh_streams                        the saved generator states cannot be continued: start
                                         fresh 128-bit streams at ``step`` (old torch states)
    model, optimizer, scheduler, ema     the weights and the optimizer's state
    window                               train-loss sum, examples, non-finite examples since the
                                         last evaluation
    augtest_seed, data_fingerprint, feature_norm, model_init, config, config_changes
    dpscale_version                      the dpscale that wrote it (every torch file has it, from
                                         0.1.0 on; a reader refuses a newer format naming it)

Format 1 kept plan, accountant and noise generator at the top level (written by the Trainer
itself, not by the mechanism); its oldest files had no ``rank_streams`` (one process: ``sampler``
and ``augment_generator`` at the top), no ``augtest_seed``, no non-finite count in ``window``,
and 32-bit torch generator states. Every reader loads checkpoints through ``migrate``, so no
reader sniffs keys.
"""

from __future__ import annotations

from typing import Any

import torch

from dpscale.errors import ConfigError

CHECKPOINT_FORMAT = 2
MIGRATED_FORMATS = (1,)  # older formats ``migrate`` turns into this one


def migrate(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's state in the current layout (a new dict; ``state`` is not changed).

    Raises:
        ValueError: a format this version cannot read.
    """
    file_format = state.get("format")
    if file_format == CHECKPOINT_FORMAT:
        return state
    if file_format not in MIGRATED_FORMATS:
        raise ConfigError(
            f"checkpoint format {file_format} is not one this dpscale reads ({CHECKPOINT_FORMAT} or older)"
        )
    old = dict(state)
    streams = old.pop("rank_streams", None)
    if streams is None:  # written before distributed training: one process
        streams = [
            {"sampler": old.pop("sampler"), "augment_generator": old.pop("augment_generator", None)}
        ]
    generators = [old.get("noise_generator"), *(s["sampler"].get("generator") for s in streams)]
    # 32-bit-seeded torch states: not continued
    fresh = any(isinstance(g, torch.Tensor) for g in generators)
    mechanism = {
        "plan": old.pop("plan"),
        "steps_taken": int(old["step"]),
        "sampler": None if fresh else streams[0]["sampler"],
        "noise_generator": None if fresh else old.get("noise_generator"),
        "accountant": old.pop("accountant"),
    }
    old.pop("noise_generator", None)
    return {
        **old,
        "format": CHECKPOINT_FORMAT,
        "world_size": int(old.get("world_size", 1)),
        "mechanism": mechanism,
        "rank_streams": streams,
        "fresh_streams": fresh,
        "augtest_seed": old.get("augtest_seed"),
        "window": {"nonfinite_examples": 0, **old["window"]},
        "config_changes": list(old.get("config_changes", [])),
    }

"""The ``dpscale`` command line: train, eval, plot, export, account, audit, tan, sweep, tune, data, bench, presets, models.

Kept thin: every command parses arguments, calls the library and prints. Each command family
registers its own sub-commands (``cli/train.py``, ``cli/account.py``, ...); this module assembles
the parser and decides what an error looks like: a user error (``dpscale.errors.UserError``, a file
system error, running out of memory) is one line and exit code 2; anything else is a bug and
keeps its traceback. ``DPSCALE_DEBUG=1`` shows the traceback of user errors too, causes included.
A reader that closes stdout early (``dpscale models --json | head``) is no error: the command stops
quietly with exit code 141, as a Unix tool killed by SIGPIPE does.
"""

from __future__ import annotations

import argparse
import os
import select
import sys
import warnings
from typing import Any, Callable, Sequence

from dpscale.errors import UserError

# What the user can fix: their input (config, flags, data, run directories), the file system
# (missing files, permissions, a full disk) and the machine's memory. Never ValueError or
# RuntimeError as such: one raised by a mistake in our code must show where it happened.
USER_ERRORS = (UserError, OSError, MemoryError)
# Exit code when stdout's reader has gone: 128 + SIGPIPE, what the shell reports for `yes | head`'s
# `yes` (Python ignores SIGPIPE and raises BrokenPipeError instead of dying of it).
CLOSED_STDOUT_EXIT = 141


def build_parser() -> argparse.ArgumentParser:
    """The ``dpscale`` parser with every command family's sub-commands, in the order ``--help`` lists them."""
    from dpscale.bench import add_bench_parser
    from dpscale.cli import account, audit, info, outputs, tan, train, tune
    from dpscale.cli.data import add_data_parser

    parser = argparse.ArgumentParser(
        prog="dpscale", description="Differentially private training of image classifiers"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train.add_train_parsers(sub)
    audit.add_audit_parser(sub)
    train.add_eval_parser(sub)
    outputs.add_outputs_parsers(sub)
    account.add_account_parser(sub)
    add_bench_parser(sub)
    tan.add_tan_parser(sub)
    tune.add_sweep_parser(sub)
    tune.add_tune_parser(sub)
    add_data_parser(sub)
    info.add_presets_parser(sub)
    info.add_models_parser(sub)
    return parser


def _dpscale_warnings_as_lines(show: Callable[..., None]) -> Callable[..., None]:
    """dpscale's own warnings on the command line as one "WARNING: ..." line, as the runs' other
    warnings print (Python's format names a source line the user never wrote); others as ``show`` does."""
    if getattr(show, "dpscale_lines", False):
        return show

    def shown(
        message: Any,
        category: type,
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        if f"{os.sep}dpscale{os.sep}" in filename:
            print(f"WARNING: {message}", file=file or sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)

    shown.dpscale_lines = True  # type: ignore[attr-defined]
    return shown


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``dpscale`` command.

    Args:
        argv: the command line after ``dpscale`` (default: ``sys.argv[1:]``).

    Returns:
        The exit code: the command's (0 on success), 2 for a user error (one line on stderr),
        130 when interrupted, 141 (quietly) when stdout's reader has closed it.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    warnings.showwarning = _dpscale_warnings_as_lines(warnings.showwarning)
    args = build_parser().parse_args(argv)
    args.argv = argv[2:]  # for `bench`: the flags, echoed in the report
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe fails here, not in the interpreter's exit (a traceback)
        _leave_process_group()
        return code
    except USER_ERRORS as err:
        if isinstance(err, BrokenPipeError) and _stdout_reader_gone():
            return _quiet_closed_stdout()
        # No goodbye to the other ranks here: a failure may be this rank's alone, and waiting for
        # ranks blocked in another collective would hang; torchrun stops them.
        if os.environ.get("DPSCALE_DEBUG"):
            raise
        print(f"dpscale {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _leave_process_group()  # every rank stopped at the same step (see Trainer.run)
        return 130


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has gone, so a broken pipe was the reader's choice
    (``| head``) and not a failure elsewhere (a worker's pipe), which must still be reported."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object with no descriptor
        return False
    if not hasattr(select, "poll"):  # no way to ask (Windows): the usual cause is assumed
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    # The write end of a pipe with no reader left polls as an error (POLLERR; POLLHUP: sockets).
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _quiet_closed_stdout() -> int:
    """Stop quietly after stdout's reader has gone; returns ``CLOSED_STDOUT_EXIT``.

    Python's recommended pattern (the ``signal`` module's note on SIGPIPE): stdout is pointed at
    devnull, so flushing what is still buffered at exit cannot fail a second time.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return CLOSED_STDOUT_EXIT


def _one_line(err: BaseException) -> str:
    """The error's message on one line (its type's name when it has none, as MemoryError may)."""
    text = " ".join(str(err).split())
    if isinstance(err, MemoryError):
        return f"out of memory ({text or 'MemoryError'}); DPSCALE_DEBUG=1 shows where"
    return text or type(err).__name__


def _leave_process_group() -> None:
    """End a torchrun job's process group cleanly, after every rank got here (a no-op for a
    single process)."""
    # a command that never loaded torch (dpscale account) has no group
    if "torch" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # Wait for every rank first: a rank that tears its group down while another still
        # receives the last broadcast can abort the job (gloo: "terminate called ...").
        dist.barrier()
        dist.destroy_process_group()

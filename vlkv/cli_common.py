"""What every vlkv command line shares: one-line usage errors, exit codes, running a subcommand.

Its own module so that ``vlkv``'s parser and ``vlkv serve``'s (which ``vlkv`` includes) use the same
pieces without importing each other.
"""

from __future__ import annotations

import argparse
import sys

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


def info(line: str) -> None:
    """A report line on stderr, after any answer text already printed (so a shared pipe keeps order)."""
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)


class CliError(ValueError):
    """A user error reported as one line."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line too (argparse prints the usage block first)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"vlkv: error: {message} (see {self.prog} --help)\n")


def os_error_line(err: OSError) -> str:
    """``Permission denied: /path`` rather than ``[Errno 13] Permission denied: '/path'``."""
    where = err.filename if err.filename2 is None else f"{err.filename} -> {err.filename2}"
    return f"{err.strerror}: {where}" if err.strerror and where else str(err) or type(err).__name__


def run_command(func, args, prog: str = "vlkv") -> int:
    """Run a subcommand: a user error is one line and exit 2, Ctrl-C one line and exit 130."""
    try:
        return func(args)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ValueError, FileNotFoundError, KeyError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # an unwritable or file-shaped cache or output path
        print(f"{prog}: error: {os_error_line(e)}", file=sys.stderr)
        return EXIT_USAGE

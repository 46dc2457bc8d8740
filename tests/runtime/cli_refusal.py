"""What every CLI refusal test checks: ``vlkv generate`` exits 2 with one line naming the problem."""

from __future__ import annotations

from vlkv.cli import main


def refused(capsys, *argv) -> str:
    """Run ``vlkv generate ARGV``; assert exit 2, nothing on stdout, one line on stderr (besides a first
    build's progress lines); return it."""
    try:
        code = main(["generate", "--max-new-tokens", "2", *argv])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    out, err = capsys.readouterr()
    assert code == 2, err
    assert out == ""
    # a C++ kernel's first build in this process says so first (with tests spread over workers, whichever
    # test loads a model first in a fresh venv sees it): a progress line, not part of the refusal
    lines = [line for line in err.splitlines() if not line.startswith("vlkv: building the ")]
    assert len(lines) == 1, err
    assert lines[0].startswith("vlkv: error: ")
    return lines[0]

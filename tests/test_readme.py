"""Every Python snippet of the README runs as written (with the bundled pair), in the order given;
each block in a fresh namespace unless it continues the previous one (it then starts with a comment
"# continues")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specdec_ext.zoo import pair_available

# a snippet loads the real pair: under pytest-xdist these run on the worker that converts its GGUF file once
pytestmark = pytest.mark.xdist_group("smollm2-135m")

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_has_python_snippets():
    assert len(BLOCKS) >= 2


# the namespace each block left, so that a block that continues the previous one runs in it without running the blocks
# before it again (they run in order on one worker); a block run alone first runs those it continues
_LEFT: dict[int, dict] = {}


def _namespace_after(index: int) -> dict:
    """The namespace block ``index`` left (running it, and the blocks it continues, if it has not run)."""
    if index not in _LEFT:
        continues = BLOCKS[index].lstrip().startswith("# continues")
        namespace = dict(_namespace_after(index - 1)) if continues and index > 0 else {}
        exec(compile(BLOCKS[index], f"README.md python block {index}", "exec"), namespace)
        _LEFT[index] = namespace
    return _LEFT[index]


@pytest.mark.skipif(not pair_available(), reason="the bundled pair is not in this checkout")
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_snippet_runs(index, capsys):
    _LEFT.pop(index, None)  # this block runs now, whatever ran before
    _namespace_after(index)


BASH = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)


def specdec_lines(blocks: list[str]) -> list[list[str]]:
    """The ``specdec ...`` command lines of shell blocks (continuations joined, comments cut; a ``torchrun ...
    specdec`` line from ``specdec`` on) as argument lists without the program name."""
    import shlex

    out = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if "specdec" in words:
                out.append(words[words.index("specdec") + 1:])
    return out


def test_every_specdec_line_of_the_readme_parses():
    """Each documented CLI line is accepted by the real parser (argparse exits on an unknown flag or bad value)."""
    from specdec_ext.cli import build_parser

    lines = specdec_lines(BASH)
    assert len(lines) >= 5
    for argv in lines:
        try:
            build_parser().parse_args(argv)
        except SystemExit as e:
            raise AssertionError(f"README line `specdec {' '.join(argv)}` does not parse") from e


def test_the_parse_check_catches_a_bad_line():
    """Negative control: a line with a flag the CLI does not have is caught."""
    from specdec_ext.cli import build_parser

    [argv] = specdec_lines(["specdec generate --prompt x --no-such-flag 3\n"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)


def test_every_kept_result_is_listed_with_its_command():
    """docs/results/README.md lists each file of docs/results (with its command, commit, machine and date) and no file
    that is not there, at most 30; the README and docs/ cite as ``docs/results/NAME`` only files that are there
    (earlier ones as ``COMMIT:docs/results/NAME``, ``git show COMMIT:PATH``)."""
    root = Path(__file__).resolve().parents[1]
    results = root / "docs" / "results"
    index = (results / "README.md").read_text()
    listed = set()
    for row in re.findall(r"^\| ([^|]+) \|", index, re.M):
        listed.update(re.findall(r"`([^`]+)`", row))
    present = {p.name for p in results.iterdir()} - {"README.md"}
    assert listed == present, (sorted(present - listed), sorted(listed - present))
    assert len(present) <= 30
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        cited = re.findall(r"(?<![0-9a-f]:)docs/results/([\w.-]+\w)", doc.read_text())
        assert set(cited) - {"README.md"} <= present, (doc.name, sorted(set(cited) - present))

"""Every Python snippet of the README runs as written (with the bundled pair), in the order given;
each block in a fresh namespace unless it continues the previous one (it then starts with a comment
"# continues")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specdec_ext.zoo import pair_available

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_has_python_snippets():
    assert len(BLOCKS) >= 2


@pytest.mark.skipif(not pair_available(), reason="the bundled pair is not in this checkout")
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_snippet_runs(index, capsys):
    namespace: dict = {}
    start = index
    while start > 0 and BLOCKS[start].lstrip().startswith("# continues"):
        start -= 1
    for block in BLOCKS[start : index + 1]:
        exec(compile(block, f"README.md python block {index}", "exec"), namespace)

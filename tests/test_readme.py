"""The README's "offload your own layer" example runs and holds what it asserts."""

import re

from tests.conftest import ROOT


def test_readme_example_runs(capsys):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Offload your own layer", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    printed = capsys.readouterr().out
    assert "block_in offload D2H H2D" in printed
    assert "block_gate device - -" in printed
    assert "block_out remat - -" in printed

"""What the README and the "your own layer" guide show holds: the layer example runs, holds what it
asserts, and compiles to no more matrix products than keeping everything (its tags sit on matmul
outputs); the README keeps the setup and test commands CI runs; every launcher command it shows is
accepted by the launcher's config checks, every script it runs exists, every config key it names
is a key of the config reference; it stays a README (at most 250 lines) whose links reach files."""

import re
import shlex
from typing import Any

import equinox as eqx
import pytest

from ferry.config.overrides import compose_node
from ferry.config.root import load_config
from ferry.offload.engine import Policy
from ferry.xla.hlo_flops import matmul_flops
from tests.conftest import CONFIGS, ROOT

README = ROOT / "README.md"
LAYER_GUIDE = ROOT / "docs" / "guides" / "own-layer.md"
CONFIG_REFERENCE = ROOT / "docs" / "reference" / "config.md"
# what a shell would have set in the README's multi-host loop
SHELL_VALUES = {"$COORD": "10.0.0.2", "$i": "0", "$TPU": "my-v5e-16", "$ZONE": "us-west4-a"}
GROUPS = "model train offload data run checkpoint log profile platform mesh distributed plan init".split()


def readme_example(capsys) -> tuple[dict, str]:
    found = re.search(r"```python\n(.*?)```", LAYER_GUIDE.read_text(), re.S)
    assert found is not None, f"{LAYER_GUIDE} has no python example"
    code = found.group(1)
    namespace = {"__name__": "readme_example"}
    exec(compile(code, str(LAYER_GUIDE.relative_to(ROOT)), "exec"), namespace)
    return namespace, capsys.readouterr().out


def compiled_grad(namespace: dict, policy: Policy) -> str:
    grad: Any = eqx.filter_jit(eqx.filter_grad(namespace["loss"]))
    return grad.lower(namespace["blocks"], namespace["x"], policy).compile().compiled.as_text()


def dots(hlo: str) -> int:
    return len(re.findall(r"\bdot\(", hlo))


def test_readme_example_runs(capsys):
    _, printed = readme_example(capsys)
    assert "block_in offload D2H after its tag H2D as its layer's backward starts" in printed
    assert "block_gate device - -" in printed
    assert "block_out remat - -" in printed


def test_readme_example_recomputes_no_saved_products(capsys):
    """Every tagged product kept (on device or host) compiles to save_all's dots and matmul FLOPs:
    nothing saved is recomputed. A tag on tanh(x @ w) would keep its matmul alive in the replay."""
    namespace, _ = readme_example(capsys)
    reference = compiled_grad(namespace, Policy.save_all())
    kept = Policy({"block_in": "offload", "block_gate": "device", "block_out": "device"})
    for policy in (kept, namespace["policy"]):
        hlo = compiled_grad(namespace, policy)
        assert dots(hlo) == dots(reference) > 0
        assert matmul_flops(hlo) == matmul_flops(reference) > 0
    remat_all = compiled_grad(namespace, Policy({}))
    assert dots(remat_all) > dots(reference)


def shell_commands(text: str) -> list[list[str]]:
    """Each command of the text's bash blocks as words: continuations joined, comments dropped,
    the multi-host loop's variables set, `--command="..."` opened up."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for name, value in SHELL_VALUES.items():
            joined = joined.replace(name, value)
        for line in joined.splitlines():
            words = shlex.split(line, comments=True)
            inner = [w.split("=", 1)[1] for w in words if w.startswith("--command=")]
            for part in [words, *(shlex.split(c) for c in inner)]:
                for command in " ".join(part).replace("&&", ";").split(";"):
                    if command.strip():
                        commands.append(command.split())
    return commands


def launcher_overrides(text: str) -> list[list[str]]:
    """The overrides of every `python launch/run.py ...` command of the text."""
    found = []
    for words in shell_commands(text):
        for i, word in enumerate(words):
            if word.endswith("launch/run.py") and i > 0 and "python" in words[i - 1]:
                found.append([w for w in words[i + 1 :] if w not in ("&", "done", "wait")])
    return found


def test_readme_keeps_the_commands_ci_runs():
    """.ci/run runs `bash setup.sh` and `.venv/bin/pytest`: the README tells a user the same."""
    commands = [" ".join(c) for c in shell_commands(README.read_text())]
    assert "bash setup.sh" in commands
    assert ".venv/bin/python launch/run.py" in commands
    assert ".venv/bin/pytest" in commands


@pytest.mark.parametrize("overrides", launcher_overrides(README.read_text()), ids=" ".join)
def test_readme_launcher_commands_are_accepted(overrides):
    """Every launcher command of the README composes into a valid config: its groups, presets,
    keys and values are ones the launcher accepts (nothing is run)."""
    load_config(compose_node("train", overrides, CONFIGS))


def test_readme_has_launcher_commands():
    assert len(launcher_overrides(README.read_text())) >= 8


def test_readme_scripts_exist():
    """Every script the README runs is in the repository."""
    scripts = set()
    for words in shell_commands(README.read_text()):
        scripts |= {w for w in words if re.fullmatch(r"[\w./-]+\.(py|sh|sbatch)", w) and "/" in w or w == "setup.sh"}
    assert {"setup.sh", "launch/run.py", "launch/export_hf.py", "scripts/offline_wheels.py"} <= scripts
    for script in scripts:
        assert (ROOT / script).is_file(), script


def reference_keys() -> set[str]:
    return set(re.findall(r"^\| `([\w.]+)` \|", CONFIG_REFERENCE.read_text(), re.M))


def test_readme_config_keys_exist():
    """Every `group.key` the README names is a key of the generated config reference (a mapping's
    entries, `offload.tensors.NAME`, by the mapping's key)."""
    keys = reference_keys()
    pattern = rf"(?<![\w/.-])((?:{'|'.join(GROUPS)})\.[a-z_][\w.]*[a-z_])"
    named = {k for k in re.findall(pattern, README.read_text()) if not k.endswith((".py", ".yaml", ".sh"))}
    assert {"mesh.fsdp", "distributed.coordinator_address", "offload.tensors.mlpwo"} <= named
    for key in named:
        parts = key.split(".")
        assert any(".".join(parts[:n]) in keys for n in range(len(parts), 1, -1)), key


def test_readme_is_a_readme_whose_links_reach_files():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        if not link.startswith(("http://", "https://")):
            assert (ROOT / link).exists(), link

"""What the README and the "your own layer" guide show holds: the layer example runs, holds what it
asserts, and compiles to no more matrix products than keeping everything (its tags sit on matmul
outputs); the README keeps the setup and test commands CI runs; every command it shows runs an
executable of the environment setup.sh makes (or a named system tool), every launcher command is
accepted by the launcher's config checks, every script it runs exists, every extra it installs is
one of pyproject.toml's, every config key it names is a key of the config reference; it stays a
README (at most 250 lines) whose links reach files."""

import re
import shlex
import sys
import tomllib
from pathlib import Path
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


# What the pages run that no Python environment holds: the shell's own words, and tools of the
# machine, a TPU VM or a cluster (a connected machine's system Python 3.11 builds the TPU VM's wheels).
SHELL_WORDS = {"bash", "cd", "export", "source", "for", "do", "done", "wait"}
SYSTEM_TOOLS = SHELL_WORDS | {"git", "scp", "gcloud", "sbatch", "python3.11"}
VENV_PATH = re.compile(r"^\.venv/bin/")


def executable(words: list[str]) -> str | None:
    """The program a command runs: its first word after `NAME=value` assignments (the inner
    command of an assignment's `$(...)`)."""
    for word in words:
        name, is_assignment, value = word.partition("=")
        if is_assignment and re.fullmatch(r"[A-Za-z_]\w*", name):
            if value.startswith("$("):
                return value[2:]
            continue
        return word
    return None


def inline_venv_commands(text: str) -> list[list[str]]:
    """The `.venv/bin/...` commands of the text's inline code (`.venv/bin/mkdocs serve`)."""
    return [span.split() for span in re.findall(r"`(\.venv/bin/[^`]+)`", text)]


def missing_executables(text: str) -> list[str]:
    """The programs of the text's commands that are neither in this interpreter's environment (the
    .venv setup.sh makes, when the tests run as `.venv/bin/pytest`) nor a named system tool. A
    command runs as written after `source .venv/bin/activate`, and `.venv/bin/X` means X there."""
    venv_bin = Path(sys.executable).parent
    missing = []
    for words in shell_commands(text) + inline_venv_commands(text):
        program = executable(words)
        if program is None or program in SYSTEM_TOOLS:
            continue
        if not (venv_bin / VENV_PATH.sub("", program)).is_file():
            missing.append(f"{program} (in: {' '.join(words)[:80]})")
    return missing


def test_every_command_of_the_readme_runs_a_program_of_the_venv():
    """`tensorboard --logdir runs/` is found after `source .venv/bin/activate` only if setup.sh
    installs it: a command whose program is not in the environment fails here (a system tool the
    README means is named in SYSTEM_TOOLS)."""
    missing = missing_executables(README.read_text())
    assert not missing, f"not in {Path(sys.executable).parent} (bash setup.sh installs it?): {missing}"


def test_the_executable_check_refuses_what_the_venv_lacks():
    text = "```bash\nno-such-tool --logdir runs/\nTPU=x; COORD=$(gcloud a b)\n```\nthen `.venv/bin/nope serve`"
    assert [m.split()[0] for m in missing_executables(text)] == ["no-such-tool", ".venv/bin/nope"]


def installed_extras(text: str) -> set[str]:
    """The extras the text installs: `bash setup.sh NAME...` and `pip install -e ".[a,b]"`."""
    named = set()
    for args in re.findall(r"bash setup\.sh((?: [a-z][\w-]*)+)", text):
        named |= set(args.split())
    for group in re.findall(r"\.\[([\w,-]+)\]", text):
        named |= set(group.split(","))
    return named


def test_every_extra_the_readme_installs_is_one_of_pyprojects():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = installed_extras(README.read_text())
    assert {"plan", "hf", "gpu", "tpu"} <= named
    assert named <= extras, named - extras


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

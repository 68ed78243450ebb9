"""The documentation site cannot go stale silently: the config reference equals a fresh generation
from the config dataclasses, every page is in the site's navigation, every file a page names is in
the repository, no page speaks of issue numbers, and (where mkdocs is installed: the `docs` extra)
the site builds with `mkdocs build --strict`; every launcher command a page shows is accepted, and
every command runs a program of the environment setup.sh makes, installing only pyproject's extras."""

import importlib.util
import os
import re
import subprocess
import sys
import tomllib

import pytest

from ferry.config.overrides import compose_node
from ferry.config.root import load_config
from tests.conftest import CONFIGS, ROOT
from tests.test_readme import installed_extras, launcher_overrides, missing_executables

DOCS = ROOT / "docs"
GENERATED = DOCS / "reference" / "config.md"
# a repository path in a page: a source file, a script, a test, a config
NAMED_FILE = re.compile(
    r"(?<![\w/.<-])((?:src/ferry|benchmarks|launch|scripts|tests|configs)/[\w/.-]*\w\.(?:py|yaml|sbatch))"
)


def config_reference():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pages() -> list:
    return sorted(DOCS.rglob("*.md"))


def test_the_config_reference_is_generated_from_the_dataclasses():
    """docs/reference/config.md is what scripts/config_reference.py writes today: a key added,
    removed or re-documented in a config dataclass changes the page, and this test fails until it
    is regenerated."""
    assert GENERATED.read_text() == config_reference().reference(), (
        "docs/reference/config.md is stale: run python scripts/config_reference.py"
    )


def test_the_config_reference_walks_the_nested_configs():
    text = GENERATED.read_text()
    for key in ("train.learning_rate", "offload.auto.candidates", "data.source", "mesh.fsdp", "model.num_kv_heads"):
        assert f"| `{key}` |" in text, key
    for family in ("llama", "qwen3", "deepseek_v3"):
        assert f"`model.family: {family}`" in text


def test_every_key_of_the_config_reference_says_what_it_does():
    """Each row's last cell, the comment beside the field in its dataclass (or above it), is not
    empty: a key added without one fails here, naming the key."""
    rows = re.findall(r"^\| `([\w.]+)` \|.*\|(.*)\|$", config_reference().reference(), re.M)
    assert len(rows) > 150
    undescribed = [key for key, description in rows if not description.strip()]
    assert not undescribed, f"comment these fields, then run python scripts/config_reference.py: {undescribed}"


def page_commands() -> list[tuple[str, list[str]]]:
    return [(str(p.relative_to(DOCS)), o) for p in pages() for o in launcher_overrides(p.read_text())]


@pytest.mark.parametrize(
    ("page", "overrides"), page_commands(), ids=lambda v: " ".join(v) if isinstance(v, list) else v
)
def test_every_launcher_command_of_the_docs_is_accepted(page, overrides):
    """A page's `python launch/run.py ...` composes into a valid config (nothing is run): a
    renamed key, group or preset fails here, naming the page."""
    load_config(compose_node("train", overrides, CONFIGS))


def test_every_command_of_the_docs_runs_a_program_of_the_venv():
    """A page's commands run after `source .venv/bin/activate` in the environment setup.sh makes:
    a program that is not there (nor a named system tool) fails here, naming the page."""
    missing = [f"{p.relative_to(DOCS)}: {m}" for p in pages() for m in missing_executables(p.read_text())]
    assert not missing, f"not in {os.path.dirname(sys.executable)} (bash setup.sh installs it?): {missing}"


def test_every_extra_the_docs_install_is_one_of_pyprojects():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for page in pages():
        named = installed_extras(page.read_text())
        assert named <= extras, f"{page.relative_to(DOCS)}: {sorted(named - extras)}"


def test_the_docs_show_launcher_commands():
    assert len(page_commands()) >= 30


def test_every_page_is_in_the_navigation():
    nav = set(re.findall(r"([\w/-]+\.md)", (ROOT / "mkdocs.yml").read_text()))
    assert nav == {str(p.relative_to(DOCS)) for p in pages()}


def test_every_file_a_page_names_exists():
    missing = []
    for page in pages():
        for path in NAMED_FILE.findall(page.read_text()):
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, missing


def test_pages_speak_to_users_not_to_the_tracker():
    """Measurements say what they measured, not which ticket asked (upstream bugs, such as
    openxla/xla #46231, are named with their project)."""
    for page in pages():
        if page == GENERATED:  # its text is the dataclasses' own comments
            continue
        text = page.read_text()
        assert not re.search(r"\b[Ii]ssue \d+|\bthe seed\b", text), page
        assert not re.search(r"(?<!xla )#\d{2,}", text), page


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None, reason='mkdocs is not installed: pip install -e ".[docs]"'
)
def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr

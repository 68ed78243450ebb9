"""Build a folder of wheels that installs ferry on an offline TPU VM (no index, no internet).

Run it on a machine with internet, carry the folder over, and install there:

    python scripts/offline_wheels.py --out wheels/                     # on a connected machine
    pip install --no-index --no-deps --target ~/ferry-site wheels/*.whl # on the TPU VM
    export PYTHONPATH=$PYTHONPATH:~/ferry-site:$PWD/src

It resolves ferry's dependencies for the VM's Python (3.11 by default) and Linux x86-64, pinned
to the JAX the VM already has (`--jax`, 0.10.2 by default: Google's TPU VM image), then downloads
every wheel of that closure except what the VM brings (JAX, jaxlib, libtpu, NumPy, SciPy,
ml_dtypes, opt_einsum; `--with-jax` adds JAX, jaxlib and libtpu too). Packages published only
as source (antlr4-python3-runtime, Hydra's parser) are built into wheels here. `--extras` adds ferry's extras
(say `test`), whose wheels the same way.
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# what a TPU VM's image already holds beside its JAX: never downloaded unless --with-jax
ON_THE_VM = {"jax", "jaxlib", "libtpu", "numpy", "scipy", "ml-dtypes", "opt-einsum"}
JAX_ITSELF = {"jax", "jaxlib", "libtpu"}
# dependencies published as source only (pure Python): Hydra's parser runtime
SOURCE_ONLY = ["antlr4-python3-runtime==4.9.*"]
# manylinux tags pip must be told one by one (it matches each glibc version exactly)
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in (17, 24, 27, 28, 31, 34)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


def requirements(extras: list[str]) -> list[str]:
    """ferry's dependencies from pyproject.toml, plus those of `extras`."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = list(project["dependencies"])
    for extra in extras:
        if extra not in project["optional-dependencies"]:
            raise SystemExit(f"--extras names {extra!r}; pyproject.toml has {sorted(project['optional-dependencies'])}")
        found += project["optional-dependencies"][extra]
    return [r for r in found if not r.lower().startswith("jax>") and not r.lower().startswith("jax=")]


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def target_flags(python: str) -> list[str]:
    return ["--python-version", python, "--implementation", "cp"] + [f"--platform={p}" for p in PLATFORMS]


def resolve(requires: list[str], jax_version: str, python: str, built: Path) -> dict[str, str]:
    """name -> version of the whole dependency closure for the target machine. The requirements
    published as source only are built into wheels in `built` first (pip cannot resolve a
    foreign platform through a source package: it would backtrack to releases of years ago)."""
    for requirement in SOURCE_ONLY:
        pip("wheel", "--quiet", "--no-deps", "-w", str(built), requirement)
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        result = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
             "--only-binary=:all:", "--find-links", str(built), "--target", str(Path(scratch) / "t"),
             "--report", str(report), *target_flags(python), f"jax=={jax_version}", f"jaxlib=={jax_version}",
             *requires],
            capture_output=True, text=True,
        )  # fmt: skip
        if result.returncode != 0:
            errors = [line for line in result.stderr.splitlines() if not line.startswith("WARNING")]
            raise SystemExit("pip could not resolve ferry's dependencies for the VM:\n" + "\n".join(errors))
        installs = json.loads(report.read_text())["install"]
    return {_normal(item["metadata"]["name"]): item["metadata"]["version"] for item in installs}


def _normal(name: str) -> str:
    """A distribution's name as wheel files spell it: antlr4_python3_runtime (no version)."""
    return re.split(r"[=<>!~;\[ ]", name, maxsplit=1)[0].lower().replace("-", "_").replace(".", "_")


def download(closure: dict[str, str], out: Path, python: str, with_jax: bool) -> list[str]:
    """Every wheel of `closure` but the VM's own into `out` (those built from source already are)."""
    skipped = {_normal(n) for n in (ON_THE_VM - JAX_ITSELF if with_jax else ON_THE_VM)}
    wanted = [f"{name}=={version}" for name, version in sorted(closure.items()) if name not in skipped]
    for requirement in wanted:
        if not any(out.glob(f"{_normal(requirement)}-*.whl")):
            pip("download", "--quiet", "--no-deps", "--only-binary=:all:", *target_flags(python), "-d", str(out),
                requirement)  # fmt: skip
    return wanted


def clear_wheel_folder(out: Path) -> None:
    """Make `out` an empty folder; refuse one holding anything but wheels (a mistyped --out)."""
    if out.exists():
        others = [p.name for p in out.iterdir() if p.suffix != ".whl"] if out.is_dir() else [out.name]
        if others:
            raise SystemExit(
                f"--out {out} holds {others[:5]} besides wheels; give an empty or new folder (it is made anew)"
            )
        shutil.rmtree(out)
    out.mkdir(parents=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / ".whl-tpu", help="folder for the wheels (made anew)")
    parser.add_argument("--python", default="3.11", help="the VM's Python version")
    parser.add_argument("--jax", default="0.10.2", help="the JAX version installed on the VM")
    parser.add_argument("--with-jax", action="store_true", help="also download jax, jaxlib and libtpu")
    parser.add_argument("--extras", nargs="*", default=[], help="ferry extras to include, e.g. test")
    args = parser.parse_args()
    clear_wheel_folder(args.out)
    closure = resolve(requirements(args.extras), args.jax, args.python, args.out)
    wanted = download(closure, args.out, args.python, args.with_jax)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"{len(wanted)} wheels, {size / 2**20:.1f} MiB, in {args.out}")
    print(f"on the VM: pip install --no-index --no-deps --target SITE {args.out.name}/*.whl; "
          "export PYTHONPATH=$PYTHONPATH:SITE:$PWD/src")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The README's "offload your own layer" example runs, holds what it asserts, and compiles to
no more matrix products than keeping everything: its tags sit on matmul outputs."""

import re

import equinox as eqx

from ferry.offload import Policy
from ferry.xla.hlo_flops import matmul_flops
from tests.conftest import ROOT


def readme_example(capsys) -> tuple[dict, str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Offload your own layer", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace = {"__name__": "readme_example"}
    exec(compile(code, "README.md", "exec"), namespace)
    return namespace, capsys.readouterr().out


def compiled_grad(namespace: dict, policy: Policy) -> str:
    grad = eqx.filter_jit(eqx.filter_grad(namespace["loss"]))
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

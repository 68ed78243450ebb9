"""The guides' measured figures are the results pages' own: a guide quotes a measurement as a link
to the results section that records it, `[1.063x `full_remat`'s tokens/s at batch 8, 2026-12-06]
(../results/tpu-v5e.md#every-preset)`, and every figure and date of the link's text must appear in
that section. A speed ratio such as `1.066x` written outside such a link fails too, so a figure
cannot drift from its record unseen (the guides once gave 1.066x and 0.75x, an earlier run's,
where the record said 1.063x and 0.469x)."""

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

GUIDES = ROOT / "docs" / "guides"
# [text](../results/page.md#anchor): the text may hold inline code and one level of brackets
CITATION = re.compile(r"\[((?:[^\[\]]|\[[^\]]*\])+)\]\((\.\./results/[\w-]+\.md)#([\w-]+)\)")
FIGURE = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+\.\d+)x?(?![\w.])")  # 53,397 / 1.063x / 0.81
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
RATIO = re.compile(r"(?<![\w.])\d+\.\d{2,}x\b")  # a measured speed ratio: 1.063x, 0.47x


def slug(heading: str) -> str:
    """The anchor mkdocs' toc gives a heading (Python-Markdown's default slugify)."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower())


def section(page: Path, anchor: str) -> str:
    """The text under the heading whose anchor is `anchor`, up to the next heading of its level or
    above ('' if the page has no such heading)."""
    lines = page.read_text().splitlines()
    for start, line in enumerate(lines):
        found = re.match(r"(#+) (.*)", line)
        if found and slug(found.group(2)) == anchor:
            level = len(found.group(1))
            end = next(
                (i for i in range(start + 1, len(lines)) if re.match(rf"#{{1,{level}}} ", lines[i])),
                len(lines),
            )
            return "\n".join(lines[start:end])
    return ""


def citations(text: str) -> list[tuple[str, str, str]]:
    return [(m.group(1), m.group(2), m.group(3)) for m in CITATION.finditer(" ".join(text.split()))]


def disagreements(guide: Path) -> list[str]:
    """Each cited figure or date missing from its section, and each cited section that is not there."""
    found = []
    for quoted, page, anchor in citations(guide.read_text()):
        record = section((guide.parent / page).resolve(), anchor)
        if not record:
            found.append(f"{page}#{anchor}: no such section")
            continue
        numbers, figures = set(FIGURE.findall(record)), FIGURE.findall(DATE.sub("", quoted))
        found += [f"{figure} is not in {page}#{anchor} ({quoted!r})" for figure in figures if figure not in numbers]
        dates = DATE.findall(quoted)
        if figures and not dates:  # a link with no figure is a plain link
            found.append(f"{quoted!r} gives no date")
        found += [f"{date} is not in {page}#{anchor}" for date in dates if date not in record]
    return found


def uncited_ratios(guide: Path) -> list[str]:
    """The speed ratios of the guide's prose (code blocks aside) outside a citation."""
    text = re.sub(r"```.*?```", "", " ".join(guide.read_text().split("\n")), flags=re.S)
    return RATIO.findall(CITATION.sub("", " ".join(text.split())))


def guides() -> list[Path]:
    return sorted(GUIDES.glob("*.md"))


@pytest.mark.parametrize("guide", guides(), ids=lambda p: p.name)
def test_every_cited_figure_is_in_its_record(guide):
    assert not disagreements(guide)


@pytest.mark.parametrize("guide", guides(), ids=lambda p: p.name)
def test_every_speed_ratio_of_a_guide_cites_its_record(guide):
    assert not uncited_ratios(guide), "write it as [figure, date](../results/PAGE.md#section)"


def test_the_guides_cite_their_figures():
    cited = [c for g in guides() for c in citations(g.read_text())]
    assert len(cited) >= 6


def test_a_figure_of_another_run_is_found_out(tmp_path):
    """The drift this test is for: 1.066x (run 3's) cited to the section of run 4, a wrong date, a
    missing section, a figure without its date, and a ratio with no citation."""
    results, guides_dir = tmp_path / "results", tmp_path / "guides"
    results.mkdir(), guides_dir.mkdir()
    (results / "tpu.md").write_text(
        "# TPU\n\n## Every preset\n\n2026-12-06: minimal 1.063, 53,438\n\n## Run 3\n\n1.066\n"
    )
    guide = guides_dir / "g.md"
    guide.write_text(
        "[1.063x and 53,438 tokens/s, 2026-12-06](../results/tpu.md#every-preset) holds;\n"
        "[1.066x, 2026-12-06](../results/tpu.md#every-preset), [1.063x, 2026-12-07](../results/tpu.md#every-preset),\n"
        "[1.063x](../results/tpu.md#run-4), [0.5x](../results/tpu.md#every-preset) and 0.75x do not;\n"
        "[the record](../results/tpu.md#every-preset) is a plain link."
    )
    assert disagreements(guide) == [
        "1.066 is not in ../results/tpu.md#every-preset ('1.066x, 2026-12-06')",
        "2026-12-07 is not in ../results/tpu.md#every-preset",
        "../results/tpu.md#run-4: no such section",
        "0.5 is not in ../results/tpu.md#every-preset ('0.5x')",
        "'0.5x' gives no date",
    ]
    assert uncited_ratios(guide) == ["0.75x"]

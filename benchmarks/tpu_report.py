"""What `tpu_check.py`'s records say, for people: a Markdown table (the README's "On a TPU"
table) and a PNG of tokens/s against HBM per preset with the frontier (the cases no other case
beats in both)."""

from pathlib import Path

GIB = 2**30


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


SEQ = 2048  # the sequence of records that name none (the runs before tpu_check took --seq)


def case_records(results: list[dict]) -> list[dict]:
    return [r for r in results if "global_batch" in r]


def shape_of(r: dict) -> tuple[int, int]:
    """A case's (global batch, sequence)."""
    return r["global_batch"], r.get("seq_len") or SEQ


def shape_label(r: dict) -> str:
    """The batch, and the sequence where it is not the benchmark's 2048."""
    batch, seq = shape_of(r)
    return str(batch) if seq == SEQ else f"{batch} x {seq}"


def markdown_table(results: list[dict]) -> str:
    """One row per case, tokens/s as a ratio to full_remat's at the same batch and sequence."""
    cases = case_records(results)
    runs = list(dict.fromkeys(r.get("run", "") for r in cases))  # in order; one run: no run column
    base = {
        (r.get("run", ""), shape_of(r)): r["tokens_per_s"]
        for r in cases
        if r["preset"] == "full_remat" and "tokens_per_s" in r
    }
    header = (
        ("| run " if len(runs) > 1 else "")
        + "| batch | preset | tokens/s | vs full_remat | MFU | HBM peak (measured) GiB | compiled GiB | host GiB "
        "| exposed copies s | link floor s |\n"
        + ("|---" if len(runs) > 1 else "")
        + "|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [header]
    for r in sorted(cases, key=lambda r: (runs.index(r.get("run", "")), shape_of(r)[::-1], r["preset"])):
        run = f"| {runs.index(r.get('run', '')) + 1} " if len(runs) > 1 else ""
        if r.get("status") != "ok":
            needed = f" (needs {_gib(r['compiled_bytes'])} GiB)" if r.get("compiled_bytes") else ""
            rows.append(f"{run}| {shape_label(r)} | {r['preset']} | {r.get('status', '?')}{needed} | | | | | | | |")
            continue
        key = (r.get("run", ""), shape_of(r))
        ratio = r["tokens_per_s"] / base[key] if key in base else None
        exposed = r.get("exposed_copy_s")
        # the floor: the link's time for the step's bytes less all its compute (the
        # stores-before-reloads split of `exposed_floor_s` assumes an order a peeled stack does not keep)
        floor = max(0.0, r["link_s"] - r["compute_s"]) if "link_s" in r and "compute_s" in r else None
        mfu = r.get("mfu")
        cells = [
            shape_label(r),
            r["preset"],
            f"{r['tokens_per_s']:,.0f}",
            "-" if ratio is None else f"{ratio:.3f}",
            "-" if mfu is None else f"{mfu:.1%}",
            _gib(r.get("hbm_peak_bytes")),
            _gib(r.get("compiled_bytes")),
            _gib(r.get("host_bytes")),
            "-" if exposed is None else f"{exposed:.3f}",
            "-" if floor is None else f"{floor:.3f}",
        ]
        rows.append(run + "| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def frontier(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The (HBM, tokens/s, label) points no other point beats in both (less HBM, more tokens/s),
    by HBM."""
    kept, best = [], float("-inf")
    for point in sorted(points, key=lambda p: (p[0], -p[1])):
        if point[1] > best:
            kept.append(point)
            best = point[1]
    return kept


def plot_frontier(results: list[dict], path: Path, run: str | None = None) -> str:
    """Draw tokens/s against the measured HBM peak per case of one run (the latest, or the last
    whose label starts with `run`) into `path`; what was done."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        command = f"python benchmarks/tpu_check.py --plot {path.with_suffix('.json')}"
        return f"no PNG: matplotlib is not installed here (the bench extra); run `{command}` where it is"
    # the latest run only: a frontier compares cases of the same code
    labels = [r.get("run", "") for r in case_records(results) if run is None or r.get("run", "").startswith(run)]
    if not labels:
        return f"no PNG: no run's label starts with {run!r}"
    latest = labels[-1]
    cases = [
        r
        for r in case_records(results)
        if r.get("run", "") == latest and r.get("status") == "ok" and r.get("hbm_peak_bytes")
    ]
    figure, axes = plt.subplots(figsize=(8, 5))
    markers = "os^Dvp"
    for index, shape in enumerate(sorted({shape_of(r) for r in cases}, key=lambda s: s[::-1])):
        points = [(r["hbm_peak_bytes"] / GIB, r["tokens_per_s"], r["preset"]) for r in cases if shape_of(r) == shape]
        label = f"global batch {shape[0]}" + ("" if shape[1] == SEQ else f", seq {shape[1]}")
        axes.scatter([p[0] for p in points], [p[1] for p in points], marker=markers[index % len(markers)], label=label)
        for x, y, label in points:
            axes.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        edge = frontier(points)
        axes.plot([p[0] for p in edge], [p[1] for p in edge], linestyle="--", linewidth=0.8)
    dates = sorted({r.get("date", "") for r in cases})
    axes.set_xlabel("HBM peak, measured (GiB)")
    axes.set_ylabel("tokens/s")
    run = f"{latest.split(':')[0]}, " if latest else ""
    axes.set_title(f"Llama-shaped 386M, seq 2048 unless named, one TPU v5e ({run}{', '.join(dates)})", fontsize=10)
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return f"wrote {path} ({latest or 'the unlabelled run'})"

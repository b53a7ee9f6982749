"""PNG plots of a results dict (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def throughput(records: list[dict], path: Path, title: str) -> Path | None:
    ok = [r for r in records if "error" not in r]
    if not ok:
        return None
    plt = _plt()
    workloads = list(dict.fromkeys(r["workload"] for r in ok))
    systems = list(dict.fromkeys(r["system"] for r in ok))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(systems)
    for j, system in enumerate(systems):
        vals = [
            next(
                (
                    r["output_tokens_per_s"]
                    for r in ok
                    if (r["workload"], r["system"]) == (w, system)
                ),
                0,
            )
            for w in workloads
        ]
        bars = ax.bar([i + j * width for i in range(len(workloads))], vals, width, label=system)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(workloads))], workloads)
    ax.set_ylabel("output tokens/s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)


def sharing(records: list[dict], path: Path, title: str) -> Path | None:
    ok = [r for r in records if "error" not in r]
    if not ok:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['kind']} {r['width']}" for r in ok]
    bars = ax.bar(labels, [r["memory_saved_perc"] for r in ok], color="tab:green")
    ax.bar_label(bars, fmt="%.1f%%", fontsize=8)
    ax.axhspan(6, 30, xmax=0.5, alpha=0.12, color="tab:blue", label="paper, parallel: 6-30%")
    ax.axhspan(37, 66, xmin=0.5, alpha=0.12, color="tab:orange", label="paper, beam: 37-66%")
    ax.set_ylabel("KV memory saved by sharing (%)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)


def serving(rates: list[dict], path: Path, title: str) -> Path | None:
    ok = [r for r in rates if r.get("num_ok")]
    if not ok:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(
        [r["rate"] for r in ok],
        [r["normalized_latency_s_per_token"] for r in ok],
        marker="o",
        label="paged",
    )
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def overhead(runs: list[dict], path: Path, title: str) -> Path | None:
    runs = [r for r in runs if "phases" in r]
    if not runs:
        return None
    plt = _plt()
    names = [n for n in runs[0]["phases"] if n not in ("total", "forward_stub")]
    runs = [r for r in runs if r.get("output_kind", "DELTA") == "DELTA"] or runs
    fig, ax = plt.subplots(figsize=(7, 4))
    height = 0.8 / len(runs)
    for j, r in enumerate(runs):
        vals = [max(r["phases"][n]["p50_ms"], 1e-3) for n in names]
        ys = [i + j * height for i in range(len(names))]
        bars = ax.barh(
            ys, vals, height, label=f"vocab {r['vocab_size']}, {r.get('output_kind', '')} outputs"
        )
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_yticks([i + height * (len(runs) - 1) / 2 for i in range(len(names))], names)
    ax.set_xscale("log")
    ax.axvline(1.0, color="red", ls="--", lw=1, label="1 ms target (whole step)")
    ax.set_xlabel("ms per step (p50, log scale)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path

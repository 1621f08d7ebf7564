"""PNG plots of a load run (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

from tidegate.engine.bench.load import RequestRecord


def plot_run(
    runs: dict[str, list[RequestRecord]], events: dict[str, float], title: str, path: Path
) -> None:
    """Token gaps over time per run (one panel each) and TTFT distributions side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs) + 1, 1, figsize=(10, 2.6 * (len(runs) + 1)), squeeze=False)
    for ax, (label, records) in zip(axes[:, 0], runs.items(), strict=False):
        for group, color in (("steady", "tab:blue"), ("main", "tab:blue"), ("long", "tab:red")):
            xs, ys = [], []
            for record in records:
                if record.group != group and not (
                    group == "main" and record.group.startswith("prefix")
                ):
                    continue
                times = record.chunk_times
                xs += times[1:]
                ys += [gap * 1000 for gap in record.itls]
            if xs:
                ax.scatter(xs, ys, s=3, color=color, label=f"{group} streams", alpha=0.6)
        for name, at in events.items():
            ax.axvline(at, color="tab:red", linestyle="--", linewidth=0.8)
            ax.text(at, ax.get_ylim()[1] * 0.9, name, fontsize=7, color="tab:red")
        ax.set_ylabel("gap between tokens (ms)")
        ax.set_title(label, fontsize=9)
        ax.set_yscale("log")
    axes[-1, 0].set_xlabel("seconds since start")
    ttft_ax = axes[-1, 0]
    ttft_ax.clear()
    data = [[r.ttft * 1000 for r in records if r.ttft is not None] for records in runs.values()]
    ttft_ax.boxplot(data, tick_labels=list(runs), orientation="horizontal")
    ttft_ax.set_xlabel("time to first token (ms)")
    ttft_ax.set_xscale("log")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

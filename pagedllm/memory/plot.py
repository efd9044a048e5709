"""The simulator's figure: the share of KV memory holding token states, and the largest batch, per policy."""

from __future__ import annotations

from pathlib import Path

from pagedllm.memory.simulate import PolicyResult


def plot_results(results: dict[str, list[PolicyResult]], path: Path) -> None:
    """One row of two bar charts per trace, written as a PNG. Needs matplotlib (`pip install pagedllm[plot]`)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'pagedllm[plot]' (or pip install matplotlib)") \
            from None
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(11, 3.2 * len(results)), squeeze=False)
    for row, (trace, trace_results) in zip(axes, results.items()):
        names = [r.policy for r in trace_results]
        colors = ["tab:gray" if not name.startswith("paged") else "tab:blue" for name in names]
        panels = ((row[0], [r.token_state_pct for r in trace_results], "% of held KV slots holding token states"),
                  (row[1], [r.max_batch for r in trace_results], "largest batch (requests)"))
        for ax, values, label in panels:
            bars = ax.bar(names, values, color=colors)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
            ax.set_title(f"{trace}: {label}", fontsize=9)
            ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

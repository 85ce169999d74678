"""The ``--plot`` figure: CDFs of TTFT, ITL and E2E latency, and output throughput over time.

matplotlib is imported lazily with the non-interactive Agg backend (no display needed); it is
an optional dependency (``pip install srt-engine[bench]``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from srt.benchmark.metrics import RequestOutput, throughput_timeline


def _cdf(ax, values_ms: Sequence[float], title: str) -> None:
    if len(values_ms):
        xs = np.sort(np.asarray(values_ms, dtype=float))
        ys = np.arange(1, len(xs) + 1) / len(xs)
        ax.step(xs, ys, where="post")
        for q, style in ((50, "--"), (99, ":")):
            ax.axvline(np.percentile(xs, q), linestyle=style, color="gray", linewidth=0.8, label=f"p{q}")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests" if "ITL" not in title else "fraction of gaps")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)


def plot_results(
    outputs: Sequence[RequestOutput], start_time: float, duration_s: float, path: str, title: str
) -> None:
    """Write a 2x2 PNG of the successful requests of one run to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [o for o in outputs if o.success]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    _cdf(axes[0][0], [o.ttft * 1000 for o in ok], "TTFT CDF")
    _cdf(axes[0][1], [x * 1000 for o in ok for x in o.itl], "ITL CDF")
    _cdf(axes[1][0], [o.latency * 1000 for o in ok], "E2E latency CDF")
    ax = axes[1][1]
    bin_s = max(duration_s / 60.0, 0.5)
    xs, ys = throughput_timeline(ok, start_time, bin_s)
    if xs:
        ax.bar(xs, ys, width=bin_s, align="edge", alpha=0.7)
    ax.set_title(f"Output throughput over time ({bin_s:.1f} s bins)")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tok/s")
    ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

"""The tables and the verdict of ``bench_save_load.py`` (medians over repeats, ratios to raw and DCP)."""

from __future__ import annotations

import json
import random
import statistics
import sys
from typing import Any, Dict, List, Optional, Tuple

from benchmarks.common import fmt_table


def _load_cells(m: Dict[str, Any], runs: List[Dict[str, Any]], raw: Optional[Dict[str, Any]],
                dcp: Optional[Dict[str, Any]]) -> List[str]:
    r0 = runs[0]
    return [f"{m['load_s']:.2f}", " / ".join(f"{r['load_s']:.2f}" for r in runs),
            f"{r0['delivered_bytes'] / m['load_s'] / 1e9:.2f}",
            f"{raw['load_s'] / m['load_s']:.2f}x" if raw else "-",
            f"{dcp['load_s'] / m['load_s']:.2f}x" if dcp else "-", f"{m['load_cpu_s']:.2f}",
            _peak(runs)]


def _peak(runs: List[Dict[str, Any]]) -> str:
    """Largest peak-RSS increase of a load over the runs (MiB), '-' where not measured."""
    vals = [r.get("load_peak_rss_extra_mib") for r in runs]
    return "-" if any(v is None for v in vals) else f"{max(vals):.0f}"


def judge(ours: Dict[str, Any], raw: Dict[str, Any], dcp: Dict[str, Any]) -> Dict[str, Any]:
    """Ratios against the targets: save >= 0.9x raw and >= 1.3x DCP; load (issue 17) >= 0.8x raw
    and >= 2x DCP."""
    loaded = ours["load_s"] is not None
    v = {"save_vs_raw": round(raw["save_s"] / ours["save_s"], 3),
         "save_vs_dcp": round(dcp["save_s"] / ours["save_s"], 3),
         "load_vs_raw": round(raw["load_s"] / ours["load_s"], 3) if loaded else None,
         "load_vs_dcp": round(dcp["load_s"] / ours["load_s"], 3) if loaded else None}
    v["targets_met"] = (v["save_vs_raw"] >= 0.9 and v["save_vs_dcp"] >= 1.3
                        and (not loaded or (v["load_vs_raw"] >= 0.8 and v["load_vs_dcp"] >= 2.0)))
    return v


def summarize(results: List[Dict[str, Any]]) -> Tuple[str, Dict[str, Any]]:
    """A markdown table per layout (medians over repeats; every run's seconds listed), and the
    verdict on the targets per run and on the medians."""
    lines: List[str] = []
    verdict: Dict[str, Any] = {}
    by = {(r["layout"], r["repeat"], r["contestant"]): r for r in results}
    repeats = sorted({r["repeat"] for r in results})
    for layout in sorted({r["layout"] for r in results}, key=["tp", "dp"].index):
        med: Dict[str, Dict[str, float]] = {}
        names = list(dict.fromkeys(r["contestant"] for r in results))
        for name in names:
            runs = [by[(layout, rep, name)] for rep in repeats if (layout, rep, name) in by]
            if runs:
                med[name] = {k: statistics.median(r[k] for r in runs) if runs[0][k] is not None else None
                             for k in ("save_s", "load_s", "save_cpu_s", "load_cpu_s")}
                med[name]["runs"] = runs  # type: ignore[assignment]
        rows = []
        for name, m in med.items():
            runs = m["runs"]  # type: ignore[index]
            r0 = runs[0]
            raw, dcp = med.get("raw"), med.get("dcp")
            rows.append([
                name,
                f"{m['save_s']:.2f}", " / ".join(f"{r['save_s']:.2f}" for r in runs),
                f"{r0['state_bytes'] / m['save_s'] / 1e9:.2f}",
                f"{raw['save_s'] / m['save_s']:.2f}x" if raw else "-",
                f"{dcp['save_s'] / m['save_s']:.2f}x" if dcp else "-",
                f"{m['save_cpu_s']:.2f}", *(_load_cells(m, runs, raw, dcp) if m["load_s"] is not None else ["-"] * 7),
                r0["files"], "-" if r0["load_ok"] is None else "yes" if all(r["load_ok"] for r in runs) else "NO",
            ])
        r0 = results[0]
        lines.append(f"\n**{layout}** (state {r0['state_bytes'] / 2**30:.2f} GiB; medians of {len(repeats)} run(s), "
                     f"every run's seconds after the median)\n")
        lines.append(fmt_table(
            ["contestant", "save s", "runs", "save GB/s", "vs raw", "vs DCP", "cpu s", "load s", "runs", "load GB/s",
             "vs raw", "vs DCP", "cpu s", "load +RSS MiB", "files", "ok"], rows))

        ours_saves = [r["save_s"] for r in results if r["layout"] == layout and r["contestant"].startswith("ours")]
        if len(ours_saves) > len(repeats) and "raw" in med and "dcp" in med:
            pooled = statistics.median(ours_saves)
            lines.append(f"\nours, every save (ours and ours:<loader> share the save path): median {pooled:.2f} s of "
                         f"{len(ours_saves)} = {med['raw']['save_s'] / pooled:.2f}x raw, "
                         f"{med['dcp']['save_s'] / pooled:.2f}x DCP")
        if all(k in med for k in ("ours", "raw", "dcp")):
            verdict[f"{layout} median"] = judge(med["ours"], med["raw"], med["dcp"])
            for rep in repeats:
                if all((layout, rep, k) in by for k in ("ours", "raw", "dcp")):
                    verdict[f"{layout} run {rep + 1}"] = judge(by[(layout, rep, "ours")], by[(layout, rep, "raw")],
                                                               by[(layout, rep, "dcp")])
        lines += checksum_ab(results, layout)
    return "\n".join(lines), verdict


def checksum_ab(results: List[Dict[str, Any]], layout: str, on: str = "ours", off: str = "ours:nocrc",
                resamples: int = 2000) -> List[str]:
    """Issue 15's A/B where both contestants ran: throughput with checksums over without (seconds
    without / seconds with) for saves and loads: the ratio of the medians, the median of the per-repeat
    (paired) ratios, and a 90% interval of the ratio of medians from resampling repeats in pairs
    (bootstrap, fixed seed). This machine's noise needs the interval: one run's ratio swings by 0.1."""
    pairs = {}
    for r in results:
        if r["layout"] == layout and r["contestant"] in (on, off):
            pairs.setdefault(r["repeat"], {})[r["contestant"]] = r
    pairs = {k: v for k, v in pairs.items() if len(v) == 2}
    if not pairs:
        return []
    out = [f"\nchecksums on / off ({on} against {off}, throughput ratio, {len(pairs)} interleaved repeats):"]
    rng = random.Random(0)
    for op in ("save_s", "load_s"):
        got = [(p[on][op], p[off][op]) for p in pairs.values() if p[on][op] is not None]
        if not got:
            continue

        def ratio(sample: List[Tuple[float, float]]) -> float:
            return statistics.median(b for _, b in sample) / statistics.median(a for a, _ in sample)

        boots = sorted(ratio(rng.choices(got, k=len(got))) for _ in range(resamples))
        out.append(f"  {op[:4]}: {ratio(got):.3f}x (paired median {statistics.median(b / a for a, b in got):.3f}x; "
                   f"90% interval {boots[int(0.05 * resamples)]:.3f}x-{boots[int(0.95 * resamples) - 1]:.3f}x)")
    return out


if __name__ == "__main__":  # the A/B of saved runs: python -m benchmarks.save_load_report RESULTS.json ...
    for path in sys.argv[1:]:
        runs = json.load(open(path))["results"]
        print(path, *(line for lay in ("tp", "dp") for line in [f"[{lay}]"] + checksum_ab(runs, lay)), sep="\n")

"""What a gpu_check run found, rendered as cuda/RESULTS.md."""
from __future__ import annotations


def _fmt_rate(x) -> str:
    if x is None:
        return "—"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


class Report:
    """What the run found, rendered as cuda/RESULTS.md."""

    def __init__(self):
        self.header: list[tuple[str, str]] = []
        self.checks: list[tuple[str, bool, str]] = []
        self.bench: list[dict] = []
        self.notes: list[str] = []
        self.errors: list[str] = []
        self.sections: list[str] = []  # further markdown (kernel timings)

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append((name, bool(ok), detail))
        print(f"  {'ok  ' if ok else 'FAIL'} {name}  {detail}", flush=True)

    @property
    def failed(self) -> bool:
        return bool(self.errors) or any(not ok for _, ok, _ in self.checks)

    def markdown(self) -> str:
        out = ["# cuda backend on a GPU (`make gpu-check`)", ""]
        out += [f"- {k}: {v}" for k, v in self.header]
        out += ["", f"**Result: {'FAILED' if self.failed else 'passed'}**", "", "## Correctness", "",
                "| check | result | detail |", "|---|---|---|"]
        out += [f"| {n} | {'ok' if ok else '**FAIL**'} | {d} |" for n, ok, d in self.checks]
        if self.bench:
            out += ["", "## Throughput", "",
                    "| workload | decode_step (tok/s) | per-op path (tok/s) | roofline (tok/s) | % of roofline "
                    "| transformers (tok/s) | best / transformers | launches / uploads / downloads a step "
                    "(decode_step; per-op) |", "|---|---:|---:|---:|---:|---:|---:|---|"]
            for b in self.bench:
                fused, ours, roof, torch_ = b.get("fused"), b.get("ours"), b.get("roofline"), b.get("torch")
                best = max((x for x in (fused, ours) if x), default=None)
                pct = f"{100 * best / roof:.1f}%" if best and roof else "—"
                ratio = f"{best / torch_:.2f}x" if best and torch_ else "—"
                counts = "; ".join("/".join(map(str, b[k])) for k in ("fused_counts", "ours_counts") if b.get(k))
                out.append(f"| {b['name']} | {_fmt_rate(fused)} | {_fmt_rate(ours)} | {_fmt_rate(roof)} | {pct} "
                           f"| {_fmt_rate(torch_)} | {ratio} | {counts or '—'} |")
        out += [x for sec in self.sections for x in ("", sec.rstrip())]
        if self.notes:
            out += ["", "## Notes", ""] + [f"- {n}" for n in self.notes]
        if self.errors:
            out += ["", "## Errors", ""] + [f"```\n{e.rstrip()}\n```" for e in self.errors]
        return "\n".join(out) + "\n"

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
                    "| workload | cuda backend (tok/s) | roofline (tok/s) | % of roofline | transformers (tok/s) "
                    "| cuda / transformers |", "|---|---:|---:|---:|---:|---:|"]
            for b in self.bench:
                ours, roof, torch_ = b.get("ours"), b.get("roofline"), b.get("torch")
                pct = f"{100 * ours / roof:.1f}%" if ours and roof else "—"
                ratio = f"{ours / torch_:.2f}x" if ours and torch_ else "—"
                out.append(f"| {b['name']} | {_fmt_rate(ours)} | {_fmt_rate(roof)} | {pct} | {_fmt_rate(torch_)} "
                           f"| {ratio} |")
        out += [x for sec in self.sections for x in ("", sec.rstrip())]
        if self.notes:
            out += ["", "## Notes", ""] + [f"- {n}" for n in self.notes]
        if self.errors:
            out += ["", "## Errors", ""] + [f"```\n{e.rstrip()}\n```" for e in self.errors]
        return "\n".join(out) + "\n"

"""`cbs.report` re-exports `cbs.analysis.reports.report` (a sweep directory's per-target fits,
B_crit(L) power law, figures and report; file names in `cbs.results.files`) and
`cbs.analysis.reports.report_tables` (its Markdown tables)."""

from cbs.analysis.reports.report import (
    analyze,
    analyze_target,
    load_analysis,
    make_figures,
    read_ramps,
    seed_spread,
    write_report,
)
from cbs.analysis.reports.report_tables import (
    b_crit_cell,
    held_out_table,
    kaplan_table,
    ramp_table,
    seed_table,
    summary_table,
    to_wandb,
    unresolved,
    unresolved_text,
)

__all__ = [
    "analyze", "analyze_target", "b_crit_cell", "held_out_table", "kaplan_table",
    "load_analysis", "make_figures", "ramp_table", "read_ramps", "seed_spread", "seed_table",
    "summary_table", "to_wandb", "unresolved", "unresolved_text", "write_report",
]

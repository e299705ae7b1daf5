"""`cbs.report`: the public API of `cbs.analysis.reports.report` (the analysis of a sweep directory)
and `cbs.analysis.reports.report_tables` (its Markdown tables), re-exported: `__all__` is the union
of theirs.

Analysis of a sweep directory: per-target fits, the B_crit(L) power law, figures, a report.
The names of the files it writes are in `cbs.results.files`.
"""

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

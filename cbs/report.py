"""`cbs.report`: the public API of `cbs.analysis.report`, re-exported.

Analysis of a sweep directory: per-target fits, the B_crit(L) power law, figures, a report.
"""

from cbs.analysis.report import (  # noqa: F401
    ANALYSIS_FILE,
    FIGURES_DIR,
    RAMPS_FILE,
    REPORT_FILE,
    SweepStore,
    analyze,
    analyze_target,
    kaplan_table,
    load_analysis,
    make_figures,
    ramp_table,
    read_ramps,
    seed_spread,
    seed_table,
    summary_table,
    target_key,
    write_report,
)

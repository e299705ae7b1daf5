"""The names of the files and directories that runs, sweeps and studies write.

Writers and readers take the names from here, so the two cannot disagree.

- a run directory (`cbs.engine.trainer`): CONFIG_FILE, METRICS_FILE (the records),
  STATUS_FILE (the summary), plus `checkpoints/` and `tensorboard/` (their owners' names);
- a sweep directory (`cbs.results.store`, `cbs.sweeps`, `cbs.analysis.report`): TRIALS_FILE,
  CSV_FILE, SWEEP_FILE, RAMPS_FILE, ANALYSIS_FILE, REPORT_FILE, FIGURES_DIR, and the reference
  trajectory in REFERENCE_DIR with its exact noise measurements in REFERENCE_NOISE_FILE;
- a branch study's directory (`cbs.sweeps.branches`, `cbs.analysis.branch_report`):
  DEFINITION_FILE, BRANCHES_FILE, the reference run in REFERENCE_DIR, REFERENCE_NOISE_FILE,
  REPORT_FILE, and UNITS_DIR (the run directories of the units running);
- a comparison across studies (`cbs.analysis.compare`): REPORT_FILE, FIGURE_FILE (under the
  reference-over-seeds protocol) and PER_TRIAL_FIGURE_FILE; across
  model sizes (`cbs.analysis.sizes`): REPORT_FILE, SIZES_FILE and SIZES_FIGURE_FILE;
- a ramp payoff study (`cbs.sweeps.ramps` with out_dir, `cbs.analysis.payoff`): RAMPS_FILE,
  PAYOFF_REPORT_FILE, PAYOFF_FILE and PAYOFF_FIGURE_FILE.
"""

__all__ = [
    "ANALYSIS_FILE", "BRANCHES_FILE", "CONFIG_FILE", "CSV_FILE", "DEFINITION_FILE", "FIGURES_DIR",
    "FIGURE_FILE", "METRICS_FILE", "PAYOFF_FIGURE_FILE", "PAYOFF_FILE", "PAYOFF_REPORT_FILE",
    "PER_TRIAL_FIGURE_FILE", "RAMPS_FILE", "REFERENCE_DIR", "REFERENCE_NOISE_FILE",
    "REPORT_FILE", "SIZES_FIGURE_FILE", "SIZES_FILE", "STATUS_FILE", "SWEEP_FILE", "TRIALS_FILE",
    "UNITS_DIR",
]

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
STATUS_FILE = "status.json"

TRIALS_FILE = "trials.jsonl"
CSV_FILE = "trials.csv"
SWEEP_FILE = "sweep.json"
RAMPS_FILE = "ramps.jsonl"
ANALYSIS_FILE = "analysis.json"
REPORT_FILE = "report.md"
FIGURES_DIR = "figures"

REFERENCE_DIR = "reference"
REFERENCE_NOISE_FILE = "reference_noise.jsonl"

DEFINITION_FILE = "branch.json"
BRANCHES_FILE = "branches.jsonl"
UNITS_DIR = "units"

FIGURE_FILE = "b_crit_vs_noise.png"
PER_TRIAL_FIGURE_FILE = "b_crit_vs_noise_per_trial.png"
SIZES_FILE = "sizes.json"
SIZES_FIGURE_FILE = "b_crit_vs_loss_by_size.png"

PAYOFF_REPORT_FILE = "payoff.md"
PAYOFF_FILE = "payoff.json"
PAYOFF_FIGURE_FILE = "payoff.png"

"""The names of the files and directories that runs, sweeps and studies write.

Writers and readers take the names from here, so the two cannot disagree.

- a run directory (`cbs.engine.trainer`): CONFIG_FILE, METRICS_FILE (the records),
  STATUS_FILE (the summary), plus `checkpoints/` and `tensorboard/` (their owners' names);
- a sweep directory (`cbs.results.store`, `cbs.sweeps`, `cbs.analysis.report`): TRIALS_FILE,
  CSV_FILE, SWEEP_FILE, RAMPS_FILE, ANALYSIS_FILE, REPORT_FILE, FIGURES_DIR, and the reference
  trajectory in REFERENCE_DIR with its exact noise measurements in REFERENCE_NOISE_FILE;
- a branch study's directory (`cbs.sweeps.branches`, `cbs.analysis.branch_report`):
  DEFINITION_FILE, BRANCHES_FILE, the reference run in REFERENCE_DIR, REFERENCE_NOISE_FILE and
  REPORT_FILE;
- a comparison across studies (`cbs.analysis.compare`): REPORT_FILE and FIGURE_FILE.
"""

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

FIGURE_FILE = "b_crit_vs_noise.png"

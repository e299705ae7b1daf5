"""The names of the files and directories that runs, sweeps and studies write, for writers and
readers alike. The records files several processes may write (TRIALS_FILE, BRANCHES_FILE,
RAMPS_FILE, REFERENCE_NOISE_FILE) are write-once parts merged on read (`cbs.results.shared`),
each record identified by its keys (`trial_id`, `cbs.sweeps.branches.UNIT_KEYS`, those here).
A run directory (`cbs.engine.trainer`) holds the first group below; a sweep directory
(`cbs.results.store`) the second and the reference run's; a branch study
(`cbs.sweeps.branches`) DEFINITION_FILE, BRANCHES_FILE, REFERENCE_DIR, REFERENCE_NOISE_FILE,
REPORT_FILE and UNITS_DIR; the rest are the reports of comparisons across studies
(`cbs.analysis.studies.compare`, `sizes`) and ramp payoff studies (`cbs.sweeps.ramps`,
`cbs.analysis.studies.payoff`).
"""

__all__ = [
    "ANALYSIS_FILE", "BRANCHES_FILE", "CONFIG_FILE", "CSV_FILE", "DEFINITION_FILE", "FIGURES_DIR",
    "FIGURE_FILE", "METRICS_FILE", "PAYOFF_FIGURE_FILE", "PAYOFF_FILE", "PAYOFF_REPORT_FILE",
    "PER_TRIAL_FIGURE_FILE", "RAMPS_FILE", "RAMP_KEYS", "REFERENCE_DIR", "REFERENCE_NOISE_FILE",
    "REFERENCE_POINT_KEYS", "REFERENCE_RUN_KEYS", "REPORT_FILE", "SIZES_FIGURE_FILE",
    "SIZES_FILE", "STATUS_FILE", "SWEEP_FILE", "TRIALS_FILE", "UNITS_DIR", "WANDB_RUN_FILE",
]

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
STATUS_FILE = "status.json"
WANDB_RUN_FILE = "wandb_run.json"

TRIALS_FILE = "trials.jsonl"
CSV_FILE = "trials.csv"
SWEEP_FILE = "sweep.json"
RAMPS_FILE = "ramps.jsonl"
RAMP_KEYS = ("label",)  # what identifies a record of RAMPS_FILE
ANALYSIS_FILE = "analysis.json"
REPORT_FILE = "report.md"
FIGURES_DIR = "figures"

REFERENCE_DIR = "reference"
REFERENCE_NOISE_FILE = "reference_noise.jsonl"
# What identifies a record of REFERENCE_NOISE_FILE: in a sweep directory, the reference run;
# in a branch study's directory, the measured checkpoint.
REFERENCE_RUN_KEYS = ("batch_size", "learning_rate")
REFERENCE_POINT_KEYS = ("step",)

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

"""The packaged preset `cbs.configs.teacher_student_sweep` by its repository path
(`--config=teacher_student_sweep` names the same preset without a checkout)."""

from cbs.configs.teacher_student_sweep import *  # noqa: F403 (the module's names, for imports from here)
from cbs.configs.teacher_student_sweep import get_config  # noqa: F401 (what --config=<this file> loads)

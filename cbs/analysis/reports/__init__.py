"""Reports. Modules: `report` (a sweep's analysis) and `report_tables` (its tables), `plots`
(figures), `branch_report` (local critical batch size from branches).
"""

__all__ = ["branch_report", "plots", "report", "report_tables"]  # its modules

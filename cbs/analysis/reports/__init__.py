"""Reports. Modules: `report` (a sweep's), `report_tables`, `plots`, `branch_report`."""

__all__ = ["branch_report", "plots", "report", "report_tables"]  # its modules

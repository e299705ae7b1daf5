"""Fits, figures and reports from result files alone (`fit`, `plots`, `report`): no model,
no training code.
"""

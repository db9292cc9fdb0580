"""Parallel groups: sequence parallel, CFG parallel, and how a group's failure is agreed."""

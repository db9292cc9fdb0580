"""Runnable recipes: one short script per recipe plus YAML configs, launched by `python -m recipes.run`."""

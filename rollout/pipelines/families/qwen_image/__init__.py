"""Qwen-Image: the family folder. `family.yaml` declares its families (read by
`rollout.pipelines.families`); `adapter.py` runs their pipelines; `tiny.py` builds their tiny
pipelines and benchmark presets."""

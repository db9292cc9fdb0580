"""Wan 2.1 and Wan 2.2 text-to-video: the family folder. `family.yaml` declares its families (read by
`rollout.pipelines.families`); `adapter.py` runs their pipelines; `tiny.py` builds their tiny
pipelines and benchmark presets."""

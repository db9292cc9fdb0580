"""HunyuanVideo 1.5 text-to-video and image-to-video: the family folder. `family.yaml` declares its families (read by
`rollout.pipelines.families`); `adapter.py` runs their pipelines; `tiny.py` builds their tiny
pipelines and benchmark presets."""

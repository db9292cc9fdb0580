"""LTX-2 text-to-video and image-to-video (with audio): the family folder. `family.yaml` declares its families (read by
`rollout.pipelines.families`); `adapter.py`, `i2v.py` run their pipelines; `tiny.py` builds their tiny
pipelines and benchmark presets."""

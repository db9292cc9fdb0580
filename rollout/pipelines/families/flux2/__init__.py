"""FLUX.2 [klein] and FLUX.2 [dev]: the family folder. `family.yaml` declares its families (read by
`rollout.pipelines.families`); `adapter.py`, `dev.py` run their pipelines; `tiny.py` builds their tiny
pipelines and benchmark presets."""

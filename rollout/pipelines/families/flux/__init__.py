"""FLUX.1 and FLUX.1 Kontext: the family folder. `family.yaml` declares its families (read by
`rollout.pipelines.families`); `adapter.py`, `kontext.py` run their pipelines; `tiny.py` builds their tiny
pipelines and benchmark presets."""

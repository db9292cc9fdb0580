"""`RemoteRolloutEngine` lives beside the server it calls (`rollout.serve.client`); it is named here
too, where trainers have imported it from."""

from rollout.serve.client import RemoteRolloutEngine

__all__ = ["RemoteRolloutEngine"]

"""A reward that a reward service computes (`python -m trainers_adapters.rewards.service`): the
trainer sends each group's images as safetensors to POST /score and gets JSON scores back.

In a recipe it is a component like any other; the key comes from an environment variable, so it
never stands in a config that a run writes out:

    reward:
      judge: {reward: remote, url: http://scorer:8100, api_key_env: REWARD_SERVICE_KEY, weight: 1.0}

It scores one whole group per request (it is a `GroupwiseReward`), so a groupwise judge behind the
service gets whole groups too. The service's components come back with its total (it is a
`RewardWithComponents`), so a run logs them as an in-process composite's: the component `judge`
above, serving {clip_score, aesthetic}, logs reward/judge, reward/judge/clip_score and
reward/judge/aesthetic. Its output is checked here like any reward's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import httpx

from rollout.http.tensor_bytes import SAFETENSORS_MEDIA_TYPE
from trainers_adapters.rewards.checks import RewardError
from trainers_adapters.rewards.composite import GroupwiseReward, RewardScores, RewardWithComponents
from trainers_adapters.rewards.wire import encode_group, scores_from_json


class RemoteReward(RewardWithComponents, GroupwiseReward):
    """url: the service's base URL (http://host:port); api_key_env: the environment variable that
    holds its key (None: a service started with --no-auth); timeout_s: for one group's answer."""

    name = "remote"

    def __init__(self, url: str, api_key_env: str | None = None, timeout_s: float = 300.0):
        headers = {"content-type": SAFETENSORS_MEDIA_TYPE}
        if api_key_env is not None:
            key = os.environ.get(api_key_env)
            if not key:
                raise ValueError(
                    f"remote reward at {url}: the environment variable {api_key_env} (api_key_env) is not set; "
                    "export it with the service's key"
                )
            headers["authorization"] = f"Bearer {key}"
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = headers
        self._client: httpx.Client | None = None  # made on first use: a spec's reward may be built, then sent

    def score(self, images, prompts: Sequence[str], metadata: Sequence[dict]) -> RewardScores:
        """The service's scores of one group: its total and its components' (as the service names them)."""
        if self._client is None:
            self._client = httpx.Client(timeout=self.timeout_s, headers=self._headers)
        body = encode_group(images, prompts, metadata)
        try:
            answer = self._client.post(f"{self.url}/score", content=body)
        except httpx.HTTPError as error:
            raise RuntimeError(f"remote reward at {self.url}: the request failed: {error!r}") from error
        if answer.status_code != 200:
            try:
                message = answer.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = answer.text[:500]
            error_class = {400: RewardError, 401: PermissionError, 403: PermissionError}.get(answer.status_code)
            error_class = error_class or RuntimeError
            raise error_class(f"remote reward at {self.url} answered {answer.status_code}: {message}")
        try:
            return scores_from_json(answer.json())
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise RewardError(
                f'remote reward at {self.url}: the answer is not JSON {{"total": [...], "components": {{...}}}}: '
                f"{error!r}"
            ) from None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

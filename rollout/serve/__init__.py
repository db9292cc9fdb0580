"""The rollout service: `python -m rollout.serve --model DIR` (see `__main__` for the options, the
README for the routes and their bodies, `app` for the routes themselves)."""

API_KEY_ENV = "ROLLOUT_API_KEY"  # where the server and its launcher read the API key from

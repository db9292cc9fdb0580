"""The HTTP hardening that the rollout service (`rollout.serve`) and the reward service
(`trainers_adapters.rewards.service`) share: the names a server answers to (`hosts`), the Host,
body type and key checks (`guard`), bodies read within limits (`request_body`), and uvicorn's
protocol with bounds on request heads and a reader of streamed frame bodies (`protocol`,
`frame_body`, `chunked_frames`)."""

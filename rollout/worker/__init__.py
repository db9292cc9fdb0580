"""The worker side: a worker, its model runner, what it keeps per path, sleep levels."""
